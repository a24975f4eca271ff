"""Print a partial config YAML (e.g. configs/mesh/tpu-v5p-64.yaml) as dotted ``key=value`` overrides, one per
line, for ``stapo-jax train --config BASE.yaml $(python launch/overrides_from_yaml.py PRESET.yaml)``.

The config loader reads one YAML file; presets that only set some keys (mesh presets) are applied as
command-line overrides, which come after the file in the resolution order (stapo_jax/config/schema.py). Values are
printed as compact YAML flow scalars / lists, so they round-trip through ``yaml.safe_load``.

Exit status 2 with a message naming the file when it is missing, not YAML, or not a mapping.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml


def overrides(mapping: dict, prefix: str = "") -> list[str]:
    """``{"mesh": {"fsdp": 32}}`` -> ``["mesh.fsdp=32"]`` (nested mappings flattened; other values as YAML)."""
    out = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            out += overrides(value, f"{prefix}{key}.")
        else:
            text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
            out.append(f"{prefix}{key}={text.removesuffix(chr(10) + '...').strip()}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python launch/overrides_from_yaml.py PRESET.yaml", file=sys.stderr)
        return 2
    path = Path(argv[0])
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        print(f"overrides_from_yaml: cannot read {path}: {e}", file=sys.stderr)
        return 2
    if not isinstance(data, dict):
        print(f"overrides_from_yaml: {path} is not a mapping of config sections", file=sys.stderr)
        return 2
    print("\n".join(overrides(data)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
