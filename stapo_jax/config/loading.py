"""Configuration from YAML: unique-key YAML loading, dotted overrides and dotted-key helpers, over the typed
building of settings dataclasses in :mod:`stapo_jax.core.settings` (errors: :class:`stapo_jax.core.errors.ConfigError`).
Schema-agnostic: :mod:`stapo_jax.config.schema` holds the schema.
"""
from __future__ import annotations

from typing import Any, Mapping

import yaml

from stapo_jax.core.errors import ConfigError

__all__ = ["has_dotted", "set_dotted", "plain_copy", "parse_override", "safe_load_unique"]


def has_dotted(raw: Mapping[str, Any], key: str) -> bool:
    """Whether the nested mapping ``raw`` has the dotted ``key`` (``"actor.clip_ratio_low"``). Never raises.
    Takes str keys. Source: verl / Hydra-style dotted overrides."""
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` in the nested dict ``raw``, creating sections.

    Raises: ConfigError if a prefix of ``key`` is a value, not a section.
    Takes str keys, YAML values. Source: verl / Hydra-style dotted overrides."""
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def plain_copy(x: Any) -> Any:
    """A copy made of plain dicts and lists (YAML-safe; tuples become lists).
    Never raises. Source: ``yaml.safe_dump`` accepts only plain types."""
    if isinstance(x, Mapping):
        return {k: plain_copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_copy(v) for v in x]
    return x


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a mapping key given twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in seen:
                raise ConfigError(f"config key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                  "YAML would keep only the last one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load(text)``, except that a key repeated in one mapping raises.
    Takes YAML text in, plain YAML values out. Raises: ConfigError naming the repeated key and its
    line; yaml.YAMLError for invalid YAML. Source: YAML 1.2 §3.2.1.1 (mapping keys are unique)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``"a.b.c=value"`` into ``("a.b.c", yaml.safe_load("value"))``.

    Raises:
      ConfigError: no ``=``, an empty key, or a value that is not valid YAML.
    Takes str in, str key and YAML value out. Source: verl / Hydra-style ``key=value`` overrides.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: value {text!r} is not valid YAML: {e}") from e
    return key, value
