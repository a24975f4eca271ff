"""Results of ``stapo-jax eval``: per benchmark and setting (:class:`BenchmarkResult`), and the whole run
(:class:`EvalReport`) written as ``results.json`` and a Table 2 style ``results.md``."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from stapo_jax.tools.eval_protocol import BENCHMARKS, COLUMNS, METHOD_NAMES, PAPER_TABLE2, SETTINGS

__all__ = ["BenchmarkResult", "EvalReport", "format_cell", "json_default"]


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
      grader_stats: ``{grader: {n_timeout, n_error, n_unparsed, time_s}}`` where the grader reports them (a
        timed-out or crashed verification scores 0).
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
        """JSON-ready dict of the fields (``pass_at_k`` keys as strings)."""
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
        ordered = [c for c in COLUMNS[:-1] if c in present]
        return ordered + [c for c in dict.fromkeys(present) if c not in ordered]

    def settings(self) -> list[str]:
        """Decoding settings present (``"a"``, ``"b"``), in evaluation order."""
        return [s for s in dict.fromkeys(r.setting for r in self.results)]

    def get(self, column: str, setting: str) -> Optional[BenchmarkResult]:
        """The result for a (Table 2 column, setting), or None if not evaluated."""
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
        """The ``results.json`` payload: settings, per-setting averages, results, paper rows, meta."""
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
            cells.append(format_cell([None if v is None else v.avg_at_n for v in vals]))
        avg = format_cell([self.average(s) for s in settings])
        model = str(self.meta.get("model_name", "ours"))
        method = "**ours**" if self.label == model else f"**{self.label}** (ours)"  # no label twice in a row
        lines.append("| " + " | ".join([model, method, *cells, f"**{avg}**"]) + " |")
        for size, method in self.paper_rows:
            row = PAPER_TABLE2[(size, method)]
            idx = {c: i for i, c in enumerate(COLUMNS)}
            psets = [s for s in settings if s in row] or ["a", "b"]
            pcells = [format_cell([row[s][idx[c]] for s in psets]) if c in idx else "-" for c in cols]
            pavg = format_cell([row[s][-1] for s in psets])
            lines.append("| " + " | ".join([size, f"{METHOD_NAMES[method]} (paper)", *pcells, f"**{pavg}**"])
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
        for name, text in (("results.json", json.dumps(self.to_dict(), indent=2, default=json_default)),
                           ("results.md", self.markdown())):
            p = out / name
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, p)
            paths.append(p)
        return paths[0], paths[1]


def format_cell(values: Sequence[Optional[float]]) -> str:
    """``"a (b)"`` table cell from per-setting values (2 decimals, ``-`` for None or no values).

    ``values`` float or None scalars, returns a str; never raises. Source: the paper's results-table
    convention (main value, then the other settings in parentheses).
    """
    vals = ["-" if v is None else f"{v:.2f}" for v in values]
    if not vals:
        return "-"
    return vals[0] if len(vals) == 1 else f"{vals[0]} ({', '.join(vals[1:])})"


def json_default(x):
    """``json.dumps`` fallback: numpy scalars to Python, sets/tuples to lists, anything else to ``str``.

    Numpy int / float scalars become Python int / float, sets / tuples lists, anything else its
    str; never raises. Source: the standard-library ``json.dumps(default=...)`` convention.
    """
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


# ------------------------------------------------------------------------------------------ evaluation
