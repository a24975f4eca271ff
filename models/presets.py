"""Named Qwen3 presets (0.6B, 1.7B, 8B, 14B and their -Base variants) as ``Qwen3Config``.

The architecture numbers are those of the official HF ``config.json`` files, shipped as package data in
``stapo_jax/assets/qwen3_configs`` (sources in DATA.md); ``tests/models/test_presets.py`` checks that every number
embedded here equals them. :func:`from_hf_config` reads such a file (a preset name looked up in a config
directory, by default the shipped one, or any user path) instead.

Instruct models end turns with ``<|im_end|>`` (151645) and allow 40,960 positions; -Base models use
``<|endoftext|>`` (151643) and 32,768 (conventions.md §6). Qwen3-0.6B-Base has no shipped config.json; its
numbers are those of Qwen3-0.6B with the -Base EOS / context length (HF ``Qwen/Qwen3-0.6B-Base``).

Parameter counts (``models.qwen3.param_count``, abstract shapes only): 0.596B, 1.721B, 8.191B, 14.768B.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from models.qwen3_config import Qwen3Config
from models.special_tokens import QWEN3_ENDOFTEXT_ID, QWEN3_IM_END_ID

REPO_ROOT = Path(__file__).resolve().parents[1]

# hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, tie_word_embeddings
_SIZES = {
    "0.6B": (1024, 3072, 28, 16, True),
    "1.7B": (2048, 6144, 28, 16, True),
    "8B": (4096, 12288, 36, 32, False),
    "14B": (5120, 17408, 40, 40, False),
}
# shared by all four sizes
_COMMON = dict(vocab_size=151936, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
               bos_token_id=QWEN3_ENDOFTEXT_ID, initializer_range=0.02)
_INSTRUCT = dict(eos_token_id=QWEN3_IM_END_ID, max_position_embeddings=40960)
_BASE = dict(eos_token_id=QWEN3_ENDOFTEXT_ID, max_position_embeddings=32768)


def _arch(size: str, base: bool) -> dict:
    d, f, layers, heads, tied = _SIZES[size]
    return dict(_COMMON, hidden_size=d, intermediate_size=f, num_hidden_layers=layers, num_attention_heads=heads,
                tie_word_embeddings=tied, **(_BASE if base else _INSTRUCT))


PRESETS: dict[str, dict] = {}
for _size in _SIZES:
    PRESETS[f"Qwen3-{_size}"] = _arch(_size, base=False)
    PRESETS[f"Qwen3-{_size}-Base"] = _arch(_size, base=True)
PRESET_NAMES = tuple(PRESETS)


def canonical_name(name: str) -> str:
    """The preset key for ``name`` (case-insensitive; an ``owner/`` prefix such as ``Qwen/`` is ignored).

    Raises:
      KeyError: an unknown preset; the message lists the known names.

    Str in, str out. Source: the HF hub model names of the Qwen3 family (``Qwen/Qwen3-8B-Base``).
    """
    key = name.split("/")[-1].lower()
    if not key.startswith("qwen3-"):
        key = "qwen3-" + key
    for n in PRESETS:
        if n.lower() == key:
            return n
    raise KeyError(f"unknown Qwen3 preset {name!r}; known: {', '.join(PRESET_NAMES)}")


def preset(name: str, **overrides) -> Qwen3Config:
    """``Qwen3Config`` of a named preset from the embedded numbers (no file access).

    Args:
      name: e.g. ``"Qwen3-0.6B"``, ``"qwen3-8b-base"``, ``"Qwen/Qwen3-14B"``.
      overrides: ``Qwen3Config`` fields, e.g. ``dtype="bfloat16"``, ``remat="full"``.
    Raises:
      KeyError: unknown preset name.

    Source: the ``config.json`` numbers of the HF hub Qwen3 checkpoints (``Qwen/Qwen3-*``).
    """
    return Qwen3Config(**{**PRESETS[canonical_name(name)], **overrides})


def from_hf_config(name_or_path: Union[str, os.PathLike], config_dir: Optional[Union[str, os.PathLike]] = None,
                   **overrides) -> Qwen3Config:
    """``Qwen3Config`` read from an HF ``config.json``.

    Args:
      name_or_path: a JSON file path, a checkpoint directory holding ``config.json``, or a preset name looked
        up as ``<config_dir>/<name>.json``.
      config_dir: directory of ``<preset name>.json`` files; default the shipped
        ``stapo_jax/assets/qwen3_configs`` (:func:`stapo_jax.assets.qwen3_config_dir`).
      overrides: ``Qwen3Config`` fields (dtype, param_dtype, remat).
    Raises:
      FileNotFoundError: no such file (the message names the path tried).
      KeyError: an unknown preset name.
      stapo_jax.core.errors.ConfigError: the file is not a Qwen3 config.
    """
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        if config_dir is None:
            from stapo_jax.assets import qwen3_config_dir

            config_dir = qwen3_config_dir()
        directory = Path(config_dir)
        p = directory / f"{canonical_name(str(name_or_path))}.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no HF config.json for preset {str(name_or_path)!r}")
    return Qwen3Config.from_json(p, **overrides)


__all__ = ["PRESETS", "PRESET_NAMES", "REPO_ROOT", "canonical_name", "preset",
           "from_hf_config"]
