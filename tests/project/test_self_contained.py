"""A clone works alone (issue 12): nothing in code, configs, tests, benchmarks, launch scripts, the Makefile or
the README and docs/ refer to a ``shared`` directory beside the repository, and the data the commands need is shipped
as package data (``stapo_jax/assets``; DATA.md). CI keeps that sibling directory beside its clone, so only this
check guarantees that a user's clone, which has nothing beside it, passes too."""
from __future__ import annotations

import json
import re
from pathlib import Path

from stapo_jax.assets import BENCHMARK_NAMES, asset_path, benchmark_dir, qwen3_config_dir, qwen3_tokenizer_dir
from stapo_jax.tools.evaluate import BENCHMARKS

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("stapo_jax", "models", "configs", "tests", "bench", "launch", "scripts", "docs", "examples")
TOP_FILES = ("README.md", "Makefile", "pyproject.toml", "requirements.txt", "requirements-test.txt",
             "requirements-jetstream.txt")
TEXT_SUFFIXES = {".py", ".yaml", ".yml", ".sh", ".sbatch", ".toml", ".txt", ".md", ".cfg", ".json", ""}
# the sibling directory as a relative path, its data/ or reference/ subdirectory, or a quoted path component
SIBLING = "shared"
PATTERN = re.compile(rf"""\.\./{SIBLING}|{SIBLING}/(data|reference)|["']{SIBLING}["']""")


def _files():
    for top in TOP_FILES:
        if (REPO / top).is_file():
            yield REPO / top
    for d in SCANNED:
        for p in sorted((REPO / d).rglob("*")):
            if (p.is_file() and p.suffix in TEXT_SUFFIXES and "assets" not in p.parts
                    and "__pycache__" not in p.parts and p != Path(__file__).resolve()):    # this file names them
                yield p


def test_no_path_to_a_shared_directory_beside_the_repository():
    hits = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in _files()
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if PATTERN.search(line)]
    assert hits == [], f"references to ../{SIBLING}:\n" + "\n".join(hits)


def test_scanner_finds_what_it_looks_for(tmp_path):
    """The pattern is live: each spelling a test or a config used before issue 12 is caught."""
    for line in (f"path: ../{SIBLING}/data/qwen3_tokenizer", f'REPO.parent / "{SIBLING}" / "data"',
                 f"see {SIBLING}/reference/stapo_spec.md"):
        assert PATTERN.search(line), line
    assert not PATTERN.search("a weight shared by all layers; shared_data = 1")


def test_shipped_data_is_complete_and_small():
    assert sorted(BENCHMARK_NAMES) == sorted(BENCHMARKS)
    for name, spec in BENCHMARKS.items():
        rows = [json.loads(x) for x in (benchmark_dir() / spec.filename).read_text().splitlines() if x.strip()]
        assert len(rows) == spec.num_problems, name
        assert all(isinstance(r["problem"], str) and isinstance(r["answer"], str) for r in rows), name
    assert sorted(p.stem for p in qwen3_config_dir().glob("*.json")) == sorted(
        ["Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-1.7B-Base", "Qwen3-8B", "Qwen3-8B-Base", "Qwen3-14B", "Qwen3-14B-Base"])
    assert {p.name for p in qwen3_tokenizer_dir().iterdir()} >= {"vocab.json", "merges.txt", "tokenizer_config.json"}
    for f in ("gsm8k_train.jsonl", "gsm8k_test.jsonl", "math_train.jsonl"):
        assert asset_path("samples", f).stat().st_size < 1_000_000, f
    total = sum(p.stat().st_size for p in asset_path().rglob("*") if p.is_file() and p.suffix != ".pyc")
    assert 5e6 < total < 15e6, total
    text = (REPO / "DATA.md").read_text()
    assert all(f"{b}.jsonl" in text for b in BENCHMARK_NAMES) and "Licence" in text.replace("licence", "Licence")


def test_asset_path_names_a_missing_file():
    import pytest

    with pytest.raises(FileNotFoundError, match="no_such_file.jsonl"):
        asset_path("no_such_file.jsonl")
