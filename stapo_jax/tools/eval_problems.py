"""Benchmark problems for ``stapo-jax eval``: the shipped benchmark files (``stapo_jax/assets/benchmarks``),
any JSONL / JSON / parquet file, or an HF dataset id; and the training prompt format applied to them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from stapo_jax.tools.eval_protocol import BENCHMARKS, EvalDataError, Problem

__all__ = ["load_problems", "format_prompts", "HF_BENCHMARK_IDS"]

# The same benchmarks on the HF hub, for machines that reach it: (dataset id:split, problem key, answer key).
# ``stapo-jax eval --benchmarks ID:SPLIT data.prompt_key=... data.answer_key=...`` reads them; the shipped
# files (DATA.md) are the default and need no network.
HF_BENCHMARK_IDS: dict[str, tuple[str, str, str]] = {
    "aime24": ("HuggingFaceH4/aime_2024:train", "problem", "answer"),
    "aime25": ("math-ai/aime25:test", "problem", "answer"),
    "amc23": ("math-ai/amc23:test", "question", "answer"),
    "math500": ("HuggingFaceH4/MATH-500:test", "problem", "answer"),
    "minerva_math": ("math-ai/minervamath:test", "question", "answer"),
    "olympiadbench": ("math-ai/olympiadbench:test", "question", "answer"),
}


# ----------------------------------------------------------------------------------------------- data


def load_problems(source: str, *, data_dir: Optional[str] = None, prompt_key: str = "problem",
                  answer_key: str = "answer", limit: Optional[int] = None, split: str = "test") -> list[Problem]:
    """Read a benchmark's problems and gold answers.

    Args:
      source: a name in :data:`BENCHMARKS` (file ``<data_dir>/<name>.jsonl``), a ``.jsonl`` / ``.json`` /
        ``.parquet`` path, or an HF dataset id ``owner/name`` or ``owner/name:split`` (loaded with
        ``datasets`` when installed, else the repo's parquet/JSONL files via ``huggingface_hub``).
      data_dir: directory of the benchmark JSONL files; None = the six files shipped in the package
        (``stapo_jax/assets/benchmarks``, :func:`stapo_jax.assets.benchmark_dir`).
      prompt_key, answer_key: field names of the problem text and gold answer (numbers are converted
        to strings: JSON ``27`` -> ``"27"``).
      limit: keep the first ``limit`` problems (a slice for smoke tests); None = all.
      split: HF split when the id has none.
    Returns:
      Problems in file order.
    Raises:
      FileNotFoundError: a local path or a benchmark file that does not exist.
      EvalDataError: unreadable rows, a missing/empty problem or answer field (names file, row and key),
        no rows, or an HF id that cannot be fetched.

    A list of :class:`Problem` (int index, str problem, str answer). Source: the HF datasets
    ``problem`` / ``answer`` field convention (MATH-500, AIME; verl's ``data.prompt_key``).
    """
    if limit is not None and limit < 1:
        raise EvalDataError(f"limit={limit} must be >= 1 (or None for all problems)")
    if source in BENCHMARKS:
        from stapo_jax.assets import benchmark_dir

        path = Path(data_dir if data_dir is not None else benchmark_dir()) / BENCHMARKS[source].filename
    else:
        path = Path(source).expanduser()
    if source in BENCHMARKS or path.suffix in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(
                f"benchmark {source!r}: no such file {path}. Choose benchmarks with --benchmarks NAME,... (the "
                f"shipped ones: {', '.join(BENCHMARKS)}; unset eval.data_dir to read them from the package), a "
                f".jsonl/.json/.parquet path, or an HF dataset id owner/name[:split]")
        rows, where = _read_rows(path), str(path)
    else:
        rows, where = _read_hf(source, split), f"HF dataset {source}"
    problems = []
    for i, row in enumerate(rows[:limit] if limit else rows):
        if not isinstance(row, Mapping):
            raise EvalDataError(f"{where}: row {i} is not an object")
        for key in (prompt_key, answer_key):
            if key not in row:
                raise EvalDataError(f"{where}: row {i} has no field {key!r} (fields: {sorted(row)})")
        prob, ans = row[prompt_key], row[answer_key]
        if isinstance(ans, list) and len(ans) == 1:
            ans = ans[0]
        if isinstance(ans, (int, float)) and not isinstance(ans, bool):
            ans = str(int(ans)) if float(ans).is_integer() else str(ans)
        if not isinstance(prob, str) or not prob.strip():
            raise EvalDataError(f"{where}: row {i} field {prompt_key!r} is not a non-empty string: {prob!r:.80}")
        if not isinstance(ans, str) or not ans.strip():
            raise EvalDataError(f"{where}: row {i} field {answer_key!r} is not a non-empty string: {ans!r:.80}")
        problems.append(Problem(i, prob, ans))
    if not problems:
        raise EvalDataError(f"{where}: no problems")
    return problems


def _read_rows(path: Path) -> list:
    """Rows of a local ``.json`` (a list, ``{"data": [...]}`` or column-oriented) or, via
    :mod:`stapo_jax.data.prompts`'s reader, ``.jsonl`` / ``.parquet`` / ``.arrow`` file."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise EvalDataError(f"{path}: not valid JSON: {e}") from e
        if isinstance(data, dict):
            data = data.get("data", data)
        if isinstance(data, dict):
            keys = list(data)
            data = [dict(zip(keys, vals)) for vals in zip(*(data[k] for k in keys))]
        return list(data)
    from stapo_jax.data.prompts import BadRow, read_file

    rows = []
    for loc, rec in read_file(path, path.suffix.lstrip(".")):
        if isinstance(rec, BadRow):
            raise EvalDataError(f"{loc}: {rec.reason}")
        rows.append(rec)
    return rows


def _read_hf(dataset_id: str, split: str) -> list:
    """Rows of split ``split`` of an HF dataset id ``owner/name[:split]`` (``stapo_jax.data.prompts``'s hub reader)."""
    name, _, sp = dataset_id.partition(":")
    if name.count("/") != 1:
        raise EvalDataError(f"benchmark {dataset_id!r}: not a known benchmark ({', '.join(BENCHMARKS)}), not an "
                            f"existing .jsonl/.json/.parquet path, and not an HF dataset id owner/name[:split]")
    from stapo_jax.data.prompts import DataError, resolve_hf_files

    try:
        files = resolve_hf_files(name, sp or split)
    except DataError as e:
        raise EvalDataError(f"HF dataset {name} (split {sp or split!r}) could not be loaded: {e}") from e
    return [r for f in files for r in _read_rows(f)]


def format_prompts(problems: Sequence[Problem], tokenizer: Any, data_cfg: Any) -> list[str]:
    """The prompt text of each problem, exactly as training formats it (:func:`stapo_jax.data.prompts.format_prompt`:
    ``problem + data.prompt_suffix`` as one user turn of the chat template with the generation prompt,
    ``data.enable_thinking``; stapo_spec §7).

    Args:
      problems: the problems.
      tokenizer: the transformers tokenizer (may be None with ``data_cfg.apply_chat_template`` false).
      data_cfg: the run's ``DataConfig`` (``cfg.data``).
    Returns:
      One string per problem.
    Raises:
      stapo_jax.core.errors.ConfigError: a chat template is requested but the tokenizer has none.

    Returns a list of str of length ``len(problems)``.
    """
    from stapo_jax.data.prompts import format_prompt

    return [format_prompt(p.problem, tokenizer, data_cfg) for p in problems]
