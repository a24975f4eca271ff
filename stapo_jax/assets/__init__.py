"""Data shipped with the package (sources and licences: ``DATA.md`` at the repository root).

Layout under this package directory (installed as package data, so it is found from a wheel, an editable
install or a plain clone alike, through :mod:`importlib.resources`):

* ``benchmarks/<name>.jsonl``: the paper's six evaluation sets, complete (aime24, aime25, amc23, math500,
  minerva_math, olympiadbench), one ``{"problem", "answer", ...}`` object per line;
* ``qwen3_configs/<preset>.json``: the HF ``config.json`` files behind ``models.presets``;
* ``qwen3_tokenizer/``: the Qwen3 tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``);
* ``samples/``: small slices of GSM8K (train 600 rows, test 300 rows) and MATH train (300 rows) for tests and
  ``configs/gsm8k_tiny.yaml``.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

BENCHMARK_NAMES = ("aime24", "aime25", "amc23", "math500", "minerva_math", "olympiadbench")


def asset_path(*parts: str) -> Path:
    """Filesystem path of a shipped file or directory, e.g. ``asset_path("qwen3_tokenizer")``.

    Args:
      parts: path components below ``stapo_jax/assets`` (strings).
    Returns:
      ``pathlib.Path`` (the package is always installed unzipped: setuptools wheels and editable installs).
    Raises:
      FileNotFoundError: nothing shipped at that path (the message names it and the asset directory).
    """
    root = Path(str(resources.files("stapo_jax.assets")))
    p = root.joinpath(*parts)
    if not p.exists():
        raise FileNotFoundError(f"{p}: not among the shipped data files in {root}")
    return p


def benchmark_dir() -> Path:
    """Directory of the six shipped benchmark JSONL files (the default ``eval.data_dir``)."""
    return asset_path("benchmarks")


def qwen3_tokenizer_dir() -> Path:
    """Directory of the shipped Qwen3 tokenizer (loadable by ``transformers.AutoTokenizer.from_pretrained``)."""
    return asset_path("qwen3_tokenizer")


def qwen3_config_dir() -> Path:
    """Directory of the shipped Qwen3 HF ``config.json`` files, one ``<preset name>.json`` per preset."""
    return asset_path("qwen3_configs")


__all__ = ["BENCHMARK_NAMES", "asset_path", "benchmark_dir", "qwen3_tokenizer_dir", "qwen3_config_dir"]
