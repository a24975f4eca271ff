"""Benchmark evaluation (``stapo-jax eval``): avg@N and unbiased pass@k on the paper's six maths benchmarks in
both decoding settings, with a results table laid out like the paper's Table 2 (stapo_spec §8-9).

Protocol (stapo_spec §8): AIME24, AIME25, AMC23 at avg@32; MATH-500, Minerva, OlympiadBench at avg@4; setting
(a) T=1.0 / top-p=1.0 and setting (b) T=0.7 / top-p=0.9; at most ``eval.max_new_tokens`` (31,744) new tokens;
**Avg** is the unweighted mean of the benchmarks. Every number records the grader that produced it
(``math_verify``: math-verify, gold first; ``boxed_exact``: JustRL's strict-box string match). The paper
additionally used CompassVerifier-3B, so our scores may come out slightly lower.

The pieces are separable so tests and the trainer can use them without a model:

* :func:`load_problems` reads a benchmark (a name in :data:`BENCHMARKS`, looked up in ``eval.data_dir``; a
  JSONL/JSON/parquet path; or an HF dataset id ``owner/name[:split]``);
* :func:`format_prompts` applies the training prompt format (chat template + JustRL suffix, ``data.*``);
* a *generator* ``generate(prompts, *, num_samples, setting, max_new_tokens, seed)`` returns, per prompt,
  ``num_samples`` completions (``str`` or :class:`Completion`). :func:`engine_generator` builds one over the
  rollout driver (``stapo_jax.rollout.driver.RolloutDriver``); tests inject fakes;
* :func:`evaluate` runs benchmarks x settings and returns an :class:`EvalReport`, which writes
  ``results.json`` and ``results.md`` (:meth:`EvalReport.write`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union

import numpy as np

from stapo_jax.passk import avg_at_n, default_ks, mean_pass_at_k

log = logging.getLogger(__name__)

__all__ = ["BenchmarkSpec", "BENCHMARKS", "DecodingSetting", "SETTINGS", "PAPER_TABLE2", "EvalDataError",
           "Problem", "Completion", "Generator", "BenchmarkResult", "EvalReport", "load_problems",
           "format_prompts", "evaluate", "evaluate_benchmark", "engine_generator", "main"]


# ------------------------------------------------------------------------------------------- protocol


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark of the paper's Table 2.

    Attributes:
      name: registry key and default file stem in ``eval.data_dir`` (``aime24`` -> ``aime24.jsonl``).
      column: the Table 2 column header.
      n_samples: N of avg@N (stapo_spec §8).
      num_problems: rows of the project's data file (shared/data SOURCES.md).
    """

    name: str
    column: str
    n_samples: int
    num_problems: int

    @property
    def filename(self) -> str:
        return f"{self.name}.jsonl"


BENCHMARKS: dict[str, BenchmarkSpec] = {b.name: b for b in (
    BenchmarkSpec("aime24", "AIME24", 32, 30),
    BenchmarkSpec("aime25", "AIME25", 32, 30),
    BenchmarkSpec("amc23", "AMC23", 32, 40),
    BenchmarkSpec("math500", "MATH500", 4, 500),
    BenchmarkSpec("minerva_math", "Minerva", 4, 272),
    BenchmarkSpec("olympiadbench", "Olympiad", 4, 675),
)}


@dataclasses.dataclass(frozen=True)
class DecodingSetting:
    """A decoding setting of stapo_spec §8: ``a`` = T 1.0 / top-p 1.0 (training-aligned), ``b`` = T 0.7 /
    top-p 0.9 (the JustRL setting)."""

    name: str
    temperature: float
    top_p: float

    @property
    def label(self) -> str:
        return f"T={float(self.temperature)}, top-p={float(self.top_p)}"


SETTINGS: dict[str, DecodingSetting] = {"a": DecodingSetting("a", 1.0, 1.0), "b": DecodingSetting("b", 0.7, 0.9)}

_COLUMNS = ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad", "Avg")
# stapo_spec §9 (Table 2, v1-v3; secondary transcription, *unconfirmed*). (model, method) -> setting ->
# the seven columns above. 14B STAPO setting (a): its Avg (64.38) is not the mean of its cells (64.905).
PAPER_TABLE2: dict[tuple[str, str], dict[str, tuple[float, ...]]] = {
    ("1.7B", "grpo"): {"a": (6.88, 4.06, 40.47, 68.60, 32.44, 30.64, 30.52),
                       "b": (10.83, 4.06, 41.17, 67.15, 32.53, 30.64, 31.06)},
    ("1.7B", "entropy20"): {"a": (13.33, 8.44, 46.56, 69.85, 28.03, 35.65, 33.64),
                            "b": (13.85, 7.60, 44.53, 69.10, 29.04, 34.35, 33.08)},
    ("1.7B", "justrl"): {"a": (8.85, 6.25, 45.39, 62.70, 22.61, 29.15, 29.16),
                         "b": (14.58, 10.93, 51.09, 69.75, 28.89, 34.16, 34.90)},
    ("1.7B", "stapo"): {"a": (17.40, 15.42, 55.94, 73.55, 28.22, 38.54, 38.18),
                        "b": (16.04, 14.27, 52.42, 70.30, 29.42, 37.87, 36.72)},
    ("8B", "grpo"): {"a": (31.25, 24.69, 75.23, 88.90, 55.88, 61.50, 56.24),
                     "b": (32.40, 24.17, 74.14, 88.85, 53.58, 58.34, 55.25)},
    ("8B", "entropy20"): {"a": (31.25, 27.50, 79.92, 89.85, 54.78, 62.50, 57.63),
                          "b": (35.10, 27.39, 80.00, 89.85, 54.23, 60.39, 57.83)},
    ("8B", "justrl"): {"a": (25.21, 21.98, 73.52, 84.90, 47.33, 51.26, 50.70),
                       "b": (34.06, 26.04, 81.48, 87.55, 51.03, 56.57, 56.12)},
    ("8B", "stapo"): {"a": (33.44, 28.65, 79.92, 90.40, 57.17, 62.98, 58.76),
                      "b": (39.48, 29.37, 80.23, 91.40, 55.70, 63.32, 59.92)},
    ("14B", "grpo"): {"a": (42.19, 30.31, 81.95, 90.05, 55.15, 64.76, 60.74),
                      "b": (40.52, 32.40, 78.12, 92.00, 57.54, 64.28, 60.81)},
    ("14B", "entropy20"): {"a": (42.08, 34.06, 84.45, 91.65, 51.10, 61.30, 60.77),
                           "b": (51.25, 39.48, 87.73, 92.30, 54.78, 63.95, 64.92)},
    ("14B", "justrl"): {"a": (37.40, 26.56, 81.95, 87.65, 43.84, 57.01, 55.74),
                        "b": (52.08, 38.96, 89.61, 94.25, 58.92, 68.81, 67.11)},
    ("14B", "stapo"): {"a": (46.98, 35.21, 87.11, 92.45, 59.47, 68.21, 64.38),
                       "b": (54.27, 41.67, 90.62, 93.85, 59.93, 71.62, 68.66)},
}
_METHOD_NAMES = {"grpo": "GRPO", "entropy20": "20-Entropy", "justrl": "JustRL", "stapo": "STAPO"}


class EvalDataError(ValueError):
    """A benchmark source that cannot be read, or rows without a usable problem/answer (names the file and
    row)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One benchmark item: ``problem`` text and gold ``answer`` (strings); ``index`` is the row number."""

    index: int
    problem: str
    answer: str


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled response: ``text`` (special tokens removed), ``num_tokens`` (response tokens, EOS
    included) and ``truncated`` (stopped by the token limit, not by EOS); the last two are None when the
    generator does not know them."""

    text: str
    num_tokens: Optional[int] = None
    truncated: Optional[bool] = None


class Generator(Protocol):
    """``generate(prompts, *, num_samples, setting, max_new_tokens, seed)`` -> for each of the P prompts, a
    list of ``num_samples`` completions (``str`` or :class:`Completion`), in prompt order."""

    def __call__(self, prompts: Sequence[str], *, num_samples: int, setting: DecodingSetting,
                 max_new_tokens: int, seed: int) -> Sequence[Sequence[Union[str, Completion]]]: ...


# (responses, golds) -> scores [N] (0/1 or -1/+1; > 0 is correct), or (scores, stats mapping)
Grader = Callable[[Sequence[str], Sequence[str]], Any]


# ----------------------------------------------------------------------------------------------- data


def load_problems(source: str, *, data_dir: str = "../shared/data", prompt_key: str = "problem",
                  answer_key: str = "answer", limit: Optional[int] = None, split: str = "test") -> list[Problem]:
    """Read a benchmark's problems and gold answers.

    Args:
      source: a name in :data:`BENCHMARKS` (file ``<data_dir>/<name>.jsonl``), a ``.jsonl`` / ``.json`` /
        ``.parquet`` path, or an HF dataset id ``owner/name`` or ``owner/name:split`` (loaded with
        ``datasets`` when installed, else the repo's parquet/JSONL files via ``huggingface_hub``).
      data_dir: directory of the benchmark JSONL files (the ``../shared/data`` format).
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
    """
    if limit is not None and limit < 1:
        raise EvalDataError(f"limit={limit} must be >= 1 (or None for all problems)")
    path = Path(data_dir) / BENCHMARKS[source].filename if source in BENCHMARKS else Path(source).expanduser()
    if source in BENCHMARKS or path.suffix in (".jsonl", ".json", ".parquet") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"benchmark {source!r}: no such file {path}")
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
    :mod:`stapo_jax.data`'s reader, ``.jsonl`` / ``.parquet`` / ``.arrow`` file."""
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
    from stapo_jax.data import _Bad, _read_file

    rows = []
    for loc, rec in _read_file(path, path.suffix.lstrip(".")):
        if isinstance(rec, _Bad):
            raise EvalDataError(f"{loc}: {rec.reason}")
        rows.append(rec)
    return rows


def _read_hf(dataset_id: str, split: str) -> list:
    """Rows of split ``split`` of an HF dataset id ``owner/name[:split]`` (``stapo_jax.data``'s hub reader)."""
    name, _, sp = dataset_id.partition(":")
    if name.count("/") != 1:
        raise EvalDataError(f"benchmark {dataset_id!r}: not a known benchmark ({', '.join(BENCHMARKS)}), not an "
                            f"existing .jsonl/.json/.parquet path, and not an HF dataset id owner/name[:split]")
    from stapo_jax.data import DataError, _resolve_hf

    try:
        files = _resolve_hf(name, sp or split)
    except DataError as e:
        raise EvalDataError(f"HF dataset {name} (split {sp or split!r}) could not be loaded: {e}") from e
    return [r for f in files for r in _read_rows(f)]


def format_prompts(problems: Sequence[Problem], tokenizer: Any, data_cfg: Any) -> list[str]:
    """The prompt text of each problem, exactly as training formats it (:func:`stapo_jax.data.format_prompt`:
    ``problem + data.prompt_suffix`` as one user turn of the chat template with the generation prompt,
    ``data.enable_thinking``; stapo_spec §7).

    Args:
      problems: the problems.
      tokenizer: the transformers tokenizer (may be None with ``data_cfg.apply_chat_template`` false).
      data_cfg: the run's ``DataConfig`` (``cfg.data``).
    Returns:
      One string per problem.
    Raises:
      stapo_jax.config.ConfigError: a chat template is requested but the tokenizer has none.
    """
    from stapo_jax.data import format_prompt

    return [format_prompt(p.problem, tokenizer, data_cfg) for p in problems]


# -------------------------------------------------------------------------------------------- results


@dataclasses.dataclass
class BenchmarkResult:
    """Scores of one benchmark in one decoding setting.

    Attributes:
      benchmark, column: registry name and table column; setting, temperature, top_p: the decoding setting.
      num_problems, n_samples: P problems, N samples per problem; max_new_tokens: the generation limit.
      grader: name of the grader behind every number here (e.g. ``"math_verify"``).
      avg_at_n: avg@N in percent (stapo_spec §8).
      pass_at_k: ``{k: percent}`` by the unbiased estimator (Chen et al. 2021) for :func:`default_ks`.
      correct: [P] correct-sample counts (a sample counts as correct when its score is >= 0.5).
      mean_response_tokens, truncated_frac: over samples whose generator reported them (None otherwise).
      seconds: wall time of generation + grading.
      other_graders: ``{grader: avg@N}`` of additional graders, for the record.
      grader_stats: ``{grader: {n_timeout, n_error, time_s}}`` where the grader reports them (a timed-out or
        crashed verification scores 0).
    """

    benchmark: str
    column: str
    setting: str
    temperature: float
    top_p: float
    num_problems: int
    n_samples: int
    max_new_tokens: int
    grader: str
    avg_at_n: float
    pass_at_k: dict[int, float]
    correct: list[int]
    mean_response_tokens: Optional[float] = None
    truncated_frac: Optional[float] = None
    seconds: float = 0.0
    other_graders: dict[str, float] = dataclasses.field(default_factory=dict)
    grader_stats: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return d


@dataclasses.dataclass
class EvalReport:
    """All results of one evaluation run, plus what produced them.

    Attributes:
      label: the row label in the table (run name / checkpoint).
      results: one :class:`BenchmarkResult` per (benchmark, setting) evaluated.
      meta: free-form provenance (model, config, versions, graders, time).
      paper_rows: ``(model size, method)`` keys of :data:`PAPER_TABLE2` rows to print beside ours.
    """

    label: str
    results: list[BenchmarkResult] = dataclasses.field(default_factory=list)
    meta: dict = dataclasses.field(default_factory=dict)
    paper_rows: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def columns(self) -> list[str]:
        """Benchmark columns present, in Table 2 order then custom benchmarks in evaluation order."""
        present = [r.column for r in self.results]
        ordered = [c for c in _COLUMNS[:-1] if c in present]
        return ordered + [c for c in dict.fromkeys(present) if c not in ordered]

    def settings(self) -> list[str]:
        return [s for s in dict.fromkeys(r.setting for r in self.results)]

    def get(self, column: str, setting: str) -> Optional[BenchmarkResult]:
        return next((r for r in self.results if r.column == column and r.setting == setting), None)

    def average(self, setting: str) -> Optional[float]:
        """Unweighted mean of avg@N over the benchmarks evaluated in ``setting`` (stapo_spec §8: **Avg**);
        None when there are none."""
        vals = [r.avg_at_n for r in self.results if r.setting == setting]
        return float(np.mean(vals)) if vals else None

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat scalars for the training log: ``eval/<setting>/<benchmark>/avg@N``, ``.../pass@k`` and
        ``eval/<setting>/avg``."""
        out: dict[str, float] = {}
        for r in self.results:
            base = f"{prefix}/{r.setting}/{r.benchmark}"
            out[f"{base}/avg@{r.n_samples}"] = r.avg_at_n
            for k, v in r.pass_at_k.items():
                out[f"{base}/pass@{k}"] = v
            if r.mean_response_tokens is not None:
                out[f"{base}/response_length"] = r.mean_response_tokens
        for s in self.settings():
            out[f"{prefix}/{s}/avg"] = self.average(s)
        return out

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "settings": {s: dataclasses.asdict(SETTINGS[s]) if s in SETTINGS else None for s in self.settings()},
            "average": {s: {"avg": self.average(s), "benchmarks": [r.benchmark for r in self.results
                                                                   if r.setting == s],
                            "complete": {r.benchmark for r in self.results if r.setting == s} >= set(BENCHMARKS)}
                        for s in self.settings()},
            "results": [r.to_dict() for r in self.results],
            "paper_rows": [{"model": m, "method": k, **PAPER_TABLE2[(m, k)]} for m, k in self.paper_rows],
            "meta": self.meta,
        }

    def markdown(self) -> str:
        """Table 2 layout (stapo_spec §9): one row per model/method, each cell ``a (b)`` = setting (a) with
        setting (b) in parentheses (only the settings evaluated), then a detail table per setting."""
        cols, settings = self.columns(), self.settings()
        lines = [f"# Evaluation: {self.label}", ""]
        if settings:
            lines.append("Cells: " + " with ".join(
                f"{'(' if i else ''}setting {s}: {SETTINGS[s].label if s in SETTINGS else s}{')' if i else ''}"
                for i, s in enumerate(settings)) + "; avg@N in percent.")
        graders = sorted({r.grader for r in self.results})
        lines += [f"Grader: {', '.join(graders) or '-'} (the paper adds CompassVerifier-3B; see stapo_spec §8).",
                  ""]
        head = ["model", "method", *cols, "**Avg**"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        cells = []
        for c in cols:
            vals = [self.get(c, s) for s in settings]
            cells.append(_cell([None if v is None else v.avg_at_n for v in vals]))
        avg = _cell([self.average(s) for s in settings])
        model = self.meta.get("model_name", "ours")
        lines.append("| " + " | ".join([str(model), f"**{self.label}** (ours)", *cells, f"**{avg}**"]) + " |")
        for size, method in self.paper_rows:
            row = PAPER_TABLE2[(size, method)]
            idx = {c: i for i, c in enumerate(_COLUMNS)}
            psets = [s for s in settings if s in row] or ["a", "b"]
            pcells = [_cell([row[s][idx[c]] for s in psets]) if c in idx else "-" for c in cols]
            pavg = _cell([row[s][-1] for s in psets])
            lines.append("| " + " | ".join([size, f"{_METHOD_NAMES[method]} (paper)", *pcells, f"**{pavg}**"])
                         + " |")
        if self.paper_rows:
            lines += ["", "Paper rows: STAPO v1-v3 Table 2 (secondary transcription, *unconfirmed*); its Avg is "
                          "over all six benchmarks, ours over the columns shown."]
        for s in settings:
            label = SETTINGS[s].label if s in SETTINGS else s
            lines += ["", f"## Setting {s}: {label}", "",
                      "| benchmark | problems | N | avg@N | pass@k | mean tokens | truncated | grader |",
                      "|---|---|---|---|---|---|---|---|"]
            for c in cols:
                r = self.get(c, s)
                if r is None:
                    continue
                pk = ", ".join(f"@{k}: {v:.2f}" for k, v in r.pass_at_k.items())
                mt = "-" if r.mean_response_tokens is None else f"{r.mean_response_tokens:.1f}"
                tr = "-" if r.truncated_frac is None else f"{100 * r.truncated_frac:.1f}%"
                lines.append(f"| {c} | {r.num_problems} | {r.n_samples} | {r.avg_at_n:.2f} | {pk} | {mt} | {tr} "
                             f"| {r.grader} |")
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Union[str, os.PathLike]) -> tuple[Path, Path]:
        """Write ``results.json`` and ``results.md`` into ``out_dir`` (created; atomic replace).

        Returns:
          The two paths.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in (("results.json", json.dumps(self.to_dict(), indent=2, default=_json_default)),
                           ("results.md", self.markdown())):
            p = out / name
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, p)
            paths.append(p)
        return paths[0], paths[1]


def _cell(values: Sequence[Optional[float]]) -> str:
    vals = ["-" if v is None else f"{v:.2f}" for v in values]
    if not vals:
        return "-"
    return vals[0] if len(vals) == 1 else f"{vals[0]} ({', '.join(vals[1:])})"


def _json_default(x):
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


# ------------------------------------------------------------------------------------------ evaluation


def _seed(base: int, benchmark: str, setting: str) -> int:
    """A per-(benchmark, setting) seed, stable across runs and Python versions."""
    return (int(base) * 1_000_003 + zlib.crc32(f"{benchmark}/{setting}".encode())) % (2 ** 31)


def evaluate_benchmark(name: str, problems: Sequence[Problem], prompts: Sequence[str], generate: Generator,
                       graders: Mapping[str, Grader], *, setting: DecodingSetting, n_samples: int,
                       max_new_tokens: int, seed: int = 0, column: Optional[str] = None,
                       samples_out: Optional[Any] = None) -> BenchmarkResult:
    """Sample ``n_samples`` responses per problem, grade them and compute avg@N and pass@k.

    Args:
      name: benchmark name; column: its table column (default: the registry's, else ``name``).
      problems, prompts: P problems and their formatted prompts (same order).
      generate: the generator (see :class:`Generator`).
      graders: ordered ``{name: grader}``; the first produces the reported numbers, the others are recorded
        in ``other_graders``. A grader maps (responses, golds) to N scores (0/1 or -1/+1), or to
        ``(scores, stats)`` as :class:`stapo_jax.rewards.RewardScorer` does; a sample is correct when its
        score is > 0.
      setting, n_samples, max_new_tokens, seed: decoding.
      samples_out: optional text file; one JSON line per sample (benchmark, setting, problem, sample,
        response, scores) is written to it.
    Returns:
      :class:`BenchmarkResult`.
    Raises:
      ValueError: mismatched problems/prompts, ``n_samples`` < 1, no grader, or a generator that returned the
        wrong number of prompts/samples (named).
    """
    if len(problems) != len(prompts):
        raise ValueError(f"{name}: {len(problems)} problems but {len(prompts)} prompts")
    if n_samples < 1:
        raise ValueError(f"{name}: n_samples={n_samples} must be >= 1")
    if not graders:
        raise ValueError(f"{name}: no grader given")
    t0 = time.perf_counter()
    outs = generate(list(prompts), num_samples=n_samples, setting=setting, max_new_tokens=max_new_tokens,
                    seed=seed)
    if len(outs) != len(problems):
        raise ValueError(f"{name}: the generator returned {len(outs)} prompt results for {len(problems)} prompts")
    comps: list[Completion] = []
    for i, group in enumerate(outs):
        if len(group) != n_samples:
            raise ValueError(f"{name}: the generator returned {len(group)} samples for prompt {i}, "
                             f"expected {n_samples}")
        comps.extend(c if isinstance(c, Completion) else Completion(str(c)) for c in group)
    texts = [c.text for c in comps]
    golds = [p.answer for p in problems for _ in range(n_samples)]
    scores, grader_stats = {}, {}
    for g, fn in graders.items():
        out = fn(texts, golds)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
            out, grader_stats[g] = out[0], {k: float(v) for k, v in out[1].items()
                                            if k in ("n_timeout", "n_error", "time_s")}
        scores[g] = np.asarray(out, np.float64)
    for g, s in scores.items():
        if s.shape != (len(texts),):
            raise ValueError(f"{name}: grader {g} returned {s.shape} scores for {len(texts)} responses")
    correct = {g: (s > 0).reshape(len(problems), n_samples) for g, s in scores.items()}
    primary = next(iter(graders))
    counts = correct[primary].sum(axis=1).astype(int).tolist()
    toks = [c.num_tokens for c in comps if c.num_tokens is not None]
    trunc = [c.truncated for c in comps if c.truncated is not None]
    if samples_out is not None:
        for j, c in enumerate(comps):
            q, n = divmod(j, n_samples)
            samples_out.write(json.dumps({
                "benchmark": name, "setting": setting.name, "problem": problems[q].index, "sample": n,
                "answer": problems[q].answer, "response": c.text, "num_tokens": c.num_tokens,
                "truncated": c.truncated, "scores": {g: float(s[j]) for g, s in scores.items()}}) + "\n")
    return BenchmarkResult(
        benchmark=name, column=column or (BENCHMARKS[name].column if name in BENCHMARKS else name),
        setting=setting.name, temperature=setting.temperature, top_p=setting.top_p,
        num_problems=len(problems), n_samples=n_samples, max_new_tokens=max_new_tokens, grader=primary,
        avg_at_n=avg_at_n(correct[primary]),
        pass_at_k={k: mean_pass_at_k(n_samples, counts, k) for k in default_ks(n_samples)},
        correct=counts,
        mean_response_tokens=float(np.mean(toks)) if toks else None,
        truncated_frac=float(np.mean(trunc)) if trunc else None,
        seconds=time.perf_counter() - t0,
        other_graders={g: avg_at_n(c) for g, c in correct.items() if g != primary},
        grader_stats=grader_stats)


def evaluate(benchmarks: Mapping[str, tuple[Sequence[Problem], Sequence[str]]], generate: Generator,
             graders: Mapping[str, Grader], *, settings: Sequence[DecodingSetting] = tuple(SETTINGS.values()),
             n_samples: Union[int, Mapping[str, int], None] = None, max_new_tokens: int = 31744, seed: int = 0,
             label: str = "ours", meta: Optional[dict] = None, out_dir: Optional[Union[str, os.PathLike]] = None,
             paper_rows: Sequence[tuple[str, str]] = (), save_samples: bool = False) -> EvalReport:
    """Evaluate every benchmark in every decoding setting.

    Args:
      benchmarks: ``{name: (problems, prompts)}`` in column order.
      generate, graders: see :func:`evaluate_benchmark`.
      settings: decoding settings (default (a) and (b)).
      n_samples: samples per problem: one int for all, a ``{name: N}`` mapping (missing names fall back to
        the registry), or None = the paper's N (32 / 4; 4 for unknown benchmarks).
      max_new_tokens, seed: decoding; each (benchmark, setting) gets its own seed derived from ``seed``.
      label, meta, paper_rows: see :class:`EvalReport`.
      out_dir: if set, ``results.json``/``results.md`` are rewritten after every benchmark (a long run that
        dies keeps what it finished), and ``samples.jsonl`` holds every response with ``save_samples``.
    Returns:
      The :class:`EvalReport`.
    Raises:
      ValueError: see :func:`evaluate_benchmark`; an unknown paper row.
    """
    for key in paper_rows:
        if tuple(key) not in PAPER_TABLE2:
            raise ValueError(f"paper row {key!r} not in PAPER_TABLE2 (models 1.7B/8B/14B x {list(_METHOD_NAMES)})")
    report = EvalReport(label=label, meta=dict(meta or {}), paper_rows=[tuple(k) for k in paper_rows])
    report.meta.setdefault("graders", list(graders))
    sample_file = None
    if out_dir is not None and save_samples:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        sample_file = open(Path(out_dir) / "samples.jsonl", "w")
    try:
        for setting in settings:
            for name, (problems, prompts) in benchmarks.items():
                n = _n_for(name, n_samples)
                log.info("eval %s setting %s (%s): %d problems x %d samples", name, setting.name, setting.label,
                         len(problems), n)
                res = evaluate_benchmark(name, problems, prompts, generate, graders, setting=setting,
                                         n_samples=n, max_new_tokens=max_new_tokens,
                                         seed=_seed(seed, name, setting.name), samples_out=sample_file)
                report.results.append(res)
                log.info("eval %s setting %s: avg@%d = %.2f (%s)", name, setting.name, n, res.avg_at_n, res.grader)
                if out_dir is not None:
                    report.write(out_dir)
    finally:
        if sample_file is not None:
            sample_file.close()
    return report


def _n_for(name: str, n_samples: Union[int, Mapping[str, int], None]) -> int:
    if isinstance(n_samples, int):
        return n_samples
    if isinstance(n_samples, Mapping) and name in n_samples:
        return int(n_samples[name])
    return BENCHMARKS[name].n_samples if name in BENCHMARKS else 4


# ------------------------------------------------------------------------------------------- graders


def make_graders(names: Sequence[str], *, timeout_s: float = 10.0, num_workers: int = 4) -> dict[str, Grader]:
    """Graders by name, each over a :class:`stapo_jax.rewards.RewardScorer` scoring 0/1 and returning
    ``(scores, stats)`` (call ``.close()`` when done: pooled graders own worker processes).

    ``math_verify``: math-verify with the gold answer first, in a process pool with a per-item timeout (a
    timeout or crash scores 0 and is counted in the stats). ``boxed_exact``: JustRL's strict-box exact string
    match (the last ``\\boxed{}`` in the final 100 of the last 300 characters; stapo_spec §2).

    Raises:
      ValueError: an unknown grader name.
    """
    from stapo_jax.rewards import RewardScorer

    out: dict[str, Grader] = {}
    for name in names:
        if name not in GRADER_KINDS:
            raise ValueError(f"unknown grader {name!r}; expected one of {sorted(GRADER_KINDS)}")
        out[name] = _ScorerGrader(RewardScorer(GRADER_KINDS[name], timeout_s=timeout_s, num_workers=num_workers))
    return out


GRADER_KINDS = {"math_verify": "math_verify_01", "boxed_exact": "boxed_exact_01"}


class _ScorerGrader:
    """``(responses, golds) -> (scores, stats)`` over a RewardScorer."""

    def __init__(self, scorer):
        self.scorer = scorer

    def __call__(self, responses, golds):
        return self.scorer.score(list(responses), list(golds))

    def close(self):
        self.scorer.close()


# ---------------------------------------------------------------------------------------- generation


def engine_generator(driver: Any, tokenizer: Any, *, batch_prompts: Optional[int] = None) -> Generator:
    """A :class:`Generator` over the in-process rollout driver (``stapo_jax.rollout.driver.RolloutDriver``).

    Prompts are tokenized without special tokens (the chat template already holds them), sampled with
    ``SamplingParams(temperature, top_p)`` of the setting (full-vocabulary log-probs, top-k off), and
    decoded with special tokens removed.

    Args:
      driver: the rollout driver (its engine's ``max_decode_length`` must be >= ``max_new_tokens``).
      tokenizer: the transformers tokenizer of the model.
      batch_prompts: prompts per ``driver.generate`` call (None = all at once); smaller bounds host memory.
    Returns:
      The generator function.
    """
    from stapo_jax.rollout.sampling import SamplingParams

    def generate(prompts, *, num_samples, setting, max_new_tokens, seed):
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        sampling = SamplingParams(temperature=setting.temperature, top_p=setting.top_p)
        step = batch_prompts or len(ids)
        out = []
        for start in range(0, len(ids), step):
            chunk = ids[start:start + step]
            batch = driver.generate(chunk, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                    seed=seed + start, sampling=sampling)
            for i in range(len(chunk)):
                group = []
                for r in range(i * num_samples, (i + 1) * num_samples):
                    n = int(batch.response_lengths[r])
                    text = tokenizer.decode(batch.responses[r, :n].tolist(), skip_special_tokens=True)
                    group.append(Completion(text, n, batch.finish_reasons[r] == "length"))
                out.append(group)
        return out

    return generate


# ------------------------------------------------------------------------------------------------ CLI


def _paper_size(cfg) -> Optional[str]:
    """"1.7B" / "8B" / "14B" when ``model.path`` or ``model.preset`` names one of the paper's sizes, else None."""
    import re

    name = f"{cfg.model.path or ''} {cfg.model.preset or ''}".lower()
    m = re.search(r"(?<![\d.])(1\.7|8|14)b(?![a-z0-9])", name)
    return f"{m.group(1)}B" if m else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stapo-jax eval",
        description="Evaluate a Qwen3 checkpoint on AIME24/AIME25/AMC23 (avg@32) and MATH-500/Minerva/"
                    "OlympiadBench (avg@4) in both decoding settings; writes results.json and results.md "
                    "(Table 2 layout).")
    p.add_argument("overrides", nargs="*", help="dotted config overrides key.sub=value (e.g. model.path=DIR)")
    p.add_argument("--config", help="run config YAML (default: schema defaults)")
    p.add_argument("--model", help="HF checkpoint directory or hub id (sets model.path, clears model.preset)")
    p.add_argument("--benchmarks", help="comma-separated names, paths or HF ids (default eval.benchmarks)")
    p.add_argument("--limit", type=int, help="first N problems of each benchmark (smoke test)")
    p.add_argument("--settings", default="a,b",
                   help="decoding settings: a (T 1.0/top-p 1.0), b (T 0.7/top-p 0.9), config "
                        "(eval.temperature/top_p); comma-separated; default a,b")
    p.add_argument("--n-samples", type=int, help="samples per problem for every benchmark (default eval.n_samples)")
    p.add_argument("--max-new-tokens", type=int, help="default eval.max_new_tokens (31744)")
    p.add_argument("--graders", help="comma-separated: math_verify, boxed_exact; the first is reported "
                                     "(default eval.grader, plus the other one recorded)")
    p.add_argument("--out", help="output directory (default <trainer.run_dir>/eval)")
    p.add_argument("--label", help="row label in the table (default: the model path or preset)")
    p.add_argument("--paper", default="auto",
                   help="paper rows to print beside ours: 1.7B, 8B, 14B, none, or auto (from the model name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-prompts", type=int, help="prompts per rollout call (default: all of a benchmark)")
    p.add_argument("--save-samples", action="store_true", help="also write every response to samples.jsonl")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax eval``; returns the exit code (0 on success, 2 on a configuration or data error)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    from stapo_jax.config import ConfigError, load_config
    from stapo_jax.data import DataError

    overrides = list(args.overrides)
    if args.model:  # the checkpoint's config.json defines the model: drop the config's preset / size fields
        from stapo_jax.config import MODEL_SIZE_KEYS

        overrides += [f"model.path={args.model}", "model.preset=null"] + [f"model.{k}=null" for k in MODEL_SIZE_KEYS]
    try:
        cfg = load_config(args.config, overrides)
        settings = []
        for s in (x.strip() for x in args.settings.split(",") if x.strip()):
            if s == "config":
                settings.append(DecodingSetting("config", cfg.eval.temperature, cfg.eval.top_p))
            elif s in SETTINGS:
                settings.append(SETTINGS[s])
            else:
                raise ConfigError(f"--settings: unknown setting {s!r} (expected a, b or config)")
        grader_names = ([g.strip() for g in args.graders.split(",") if g.strip()] if args.graders else
                        [cfg.eval.grader] + [g for g in ("math_verify", "boxed_exact") if g != cfg.eval.grader])
        names = ([b.strip() for b in args.benchmarks.split(",") if b.strip()] if args.benchmarks
                 else list(cfg.eval.benchmarks))
        problems = {b: load_problems(b, data_dir=cfg.eval.data_dir, prompt_key=cfg.data.prompt_key,
                                     answer_key=cfg.data.answer_key, limit=args.limit) for b in names}
    except (ConfigError, DataError, EvalDataError, FileNotFoundError) as e:
        print(f"stapo-jax eval: {e}", file=sys.stderr)
        return 2
    max_new = cfg.eval.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
    if max_new < 1:
        print(f"stapo-jax eval: --max-new-tokens={max_new} must be >= 1", file=sys.stderr)
        return 2
    n_samples = args.n_samples if args.n_samples is not None else cfg.eval.n_samples
    size = _paper_size(cfg) if args.paper == "auto" else (None if args.paper == "none" else args.paper)
    if size is not None and size not in {k[0] for k in PAPER_TABLE2}:
        print(f"stapo-jax eval: --paper {size!r}: expected 1.7B, 8B, 14B, none or auto", file=sys.stderr)
        return 2
    paper_rows = [(size, m) for m in _METHOD_NAMES] if size else []

    import jax

    from stapo_jax.build import build_mesh, build_model, build_tokenizer
    from stapo_jax.distributed import check_same_config, initialize
    from stapo_jax.rollout import multihost_rollout
    from stapo_jax.rollout.driver import RolloutDriver
    from stapo_jax.rollout.engine import EngineConfig, Qwen3Engine
    from stapo_jax.tokenizer import stop_token_ids

    initialize()  # N processes (pod / SLURM): one sampler replica each, results identical everywhere
    check_same_config(cfg)

    tokenizer = build_tokenizer(cfg)
    benches = {b: (ps, format_prompts(ps, tokenizer, cfg.data)) for b, ps in problems.items()}
    longest = max(len(tokenizer.encode(p, add_special_tokens=False)) for _, ps in benches.values() for p in ps)
    mesh = build_mesh(cfg)
    if cfg.model.path is None:
        log.warning("model.path is unset: evaluating a RANDOMLY INITIALISED %s model (smoke test only)",
                    cfg.model.preset or "from-scratch")
    model = build_model(cfg, mesh, tokenizer, seed=cfg.trainer.seed)
    if longest + max_new > model.config.max_position_embeddings:
        print(f"stapo-jax eval: the longest prompt ({longest} tokens) + max_new_tokens ({max_new}) exceeds the "
              f"model's max_position_embeddings ({model.config.max_position_embeddings}); lower "
              f"--max-new-tokens", file=sys.stderr)
        return 2
    engine_cfg = EngineConfig(max_concurrent_decodes=cfg.rollout.max_concurrent_decodes,
                              max_prefill_length=longest, max_decode_length=max_new,
                              eos_token_ids=tuple(stop_token_ids(tokenizer)), seed=args.seed)
    if jax.process_count() > 1:
        driver = multihost_rollout(model, engine_cfg, cfg.mesh, tokenizer, pad_token_id=tokenizer.pad_token_id)
    else:
        driver = RolloutDriver(Qwen3Engine(model, engine_cfg, mesh=mesh, tokenizer=tokenizer),
                               pad_token_id=tokenizer.pad_token_id)
    generate = engine_generator(driver, tokenizer, batch_prompts=args.batch_prompts)
    graders = make_graders(grader_names, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
    label = args.label or cfg.model.path or cfg.model.preset or "from-scratch"
    from importlib.metadata import version

    meta = {"model_path": cfg.model.path, "model_preset": cfg.model.preset, "model_name": _paper_size(cfg) or Path(str(label)).name,
            "config_file": args.config, "overrides": overrides, "recipe": cfg.algorithm.recipe,
            "max_new_tokens": max_new, "limit": args.limit, "seed": args.seed,
            "prompt_suffix": cfg.data.prompt_suffix, "apply_chat_template": cfg.data.apply_chat_template,
            "enable_thinking": cfg.data.enable_thinking, "devices": [str(x) for x in jax.devices()],
            "versions": {p: version(p) for p in ("jax", "flax", "math-verify")},
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out_dir = args.out or os.path.join(cfg.trainer.run_dir, "eval")
    writer = jax.process_index() == 0  # every process evaluates (same results); process 0 writes them
    report = evaluate(benches, generate, graders, settings=settings, n_samples=n_samples,
                      max_new_tokens=max_new, seed=args.seed, label=str(label), meta=meta,
                      out_dir=out_dir if writer else None,
                      paper_rows=paper_rows, save_samples=args.save_samples)
    for g in graders.values():
        close = getattr(g, "close", None)
        if close:
            close()
    if writer:
        print(report.markdown())
        print(f"wrote {Path(out_dir) / 'results.json'} and {Path(out_dir) / 'results.md'}")
    return 0
