"""PNG training curves from runs' ``metrics.jsonl``.

* ``stapo-jax plot RUN_DIR`` (or ``RUN_DIR/metrics.jsonl``): one PNG per curve of the run plus ``curves.png``
  (all panels) in ``RUN_DIR/plots``.
* ``stapo-jax plot RUN_DIR RUN_DIR [...]`` (or ``stapo-jax compare ...``): the runs overlaid, one figure per
  metric with one line per run labelled ``<run name> (<recipe>)``, plus ``comparison.png`` (all panels) and
  ``comparison.json`` (the plotted lines: label, steps, values), in ``--out`` (default: ``compare/`` in the
  runs' common parent directory).

Held-out accuracy starts with the accuracy before RL at step 0 (``heldout_acc_before`` of the run's
``summary.json``, or of the ``summary`` the trainer passes) and ends with the accuracy after RL at the final
step when the last ``val/acc`` row is earlier.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Mapping, Optional, Sequence

from stapo_jax.train.metrics import read_metrics

# (metric key, panel title): the paper's curves plus held-out / rollout accuracy and the PPO clip fractions
CURVES = (("reward/mean", "reward"), ("val/acc", "held-out accuracy (greedy)"), ("entropy", "entropy (nats)"),
          ("s2t/masked_frac", "spurious (silenced) fraction"), ("response_length/mean", "response length (tokens)"),
          ("acc/mean", "rollout accuracy"), ("pg_clipfrac", "clip fraction (ratio clipped)"),
          ("pg_clipfrac_lower", "clip fraction (dual-clip, A < 0)"))
HELDOUT = "val/acc"
# the y axis of each curve: what is measured, in which unit
Y_LABELS = {"reward/mean": "mean reward per response (verifier score)",
            "val/acc": "accuracy (fraction of problems, 0-1)", "entropy": "mean entropy (nats per token)",
            "s2t/masked_frac": "silenced tokens (fraction of response tokens)",
            "response_length/mean": "mean length (tokens)", "acc/mean": "accuracy (fraction of responses, 0-1)",
            "pg_clipfrac": "clipped tokens (fraction of response tokens)",
            "pg_clipfrac_lower": "dual-clipped tokens (fraction of response tokens)"}
BEFORE_RL = "before RL"
# one style per run of a comparison, so that a run drawn over another with the same values stays visible
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")


def run_label(run_dir: str) -> str:
    """``<run name> (<recipe>)``: the run directory's name and ``algorithm.recipe`` of its ``config.yaml``
    (just the name when there is no config).

    Str path in, str out. Raises ``yaml.YAMLError`` for a malformed ``config.yaml`` (OSError if it
    cannot be read). Source: the run-directory layout of :mod:`stapo_jax.train` (``config.yaml``,
    ``algorithm.recipe``).
    """
    import yaml

    base = run_dir if os.path.isdir(run_dir) else os.path.dirname(os.path.abspath(run_dir))
    name = os.path.basename(os.path.normpath(os.path.abspath(base)))
    path = os.path.join(base, "config.yaml")
    if os.path.isfile(path):
        with open(path) as f:
            recipe = ((yaml.safe_load(f) or {}).get("algorithm") or {}).get("recipe")
        if recipe:
            return f"{name} ({recipe})"
    return name


def run_series(run_dir: str, summary: Optional[Mapping] = None) -> dict[str, list[tuple[int, float]]]:
    """``{metric key: [(step, value), ...]}`` for every key of :data:`CURVES` the run's metrics hold.

    ``val/acc`` gets the before-RL accuracy at step 0 and the after-RL accuracy at ``final_step`` (when not
    already there) from ``summary`` merged over ``<run_dir>/summary.json``.

    Raises:
      FileNotFoundError: no metrics file; ValueError: a malformed metrics line (see ``read_metrics``).

    Lists of ``(int step, float value)``. Source: the run's ``metrics.jsonl`` keys (verl metric names,
    e.g. ``actor/entropy``, ``critic/score/mean``).
    """
    rows = read_metrics(run_dir)
    base = run_dir if os.path.isdir(run_dir) else os.path.dirname(os.path.abspath(run_dir))
    info: dict = {}
    path = os.path.join(base, "summary.json")
    if os.path.isfile(path):
        with open(path) as f:
            info.update(json.load(f))
    info.update(summary or {})
    series = {}
    for key, _ in CURVES:
        pts = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
        if key == HELDOUT:
            if isinstance(info.get("heldout_acc_before"), (int, float)):
                pts = [(0, float(info["heldout_acc_before"]))] + [p for p in pts if p[0] != 0]
            final, after = info.get("final_step"), info.get("heldout_acc_after")
            if isinstance(after, (int, float)) and isinstance(final, int) and (not pts or pts[-1][0] < final):
                pts.append((final, float(after)))
        if pts:
            series[key] = pts
    return series


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _out_dir(out_dir: str) -> str:
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"plot output directory {out_dir} is an existing file, not a directory")
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


def draw_panel(ax, key: str, title: str, lines: Sequence[tuple[Optional[str], Sequence[int], Sequence[float]]]):
    """Draw one curve panel on the matplotlib ``ax``: each ``(label, steps, values)`` line (int steps, float
    values) with its own marker and line style (runs with equal values stay visible: hollow markers of
    decreasing size over each other), a legend when labelled, the y label with its unit (:data:`Y_LABELS`), and
    for held-out accuracy a "before RL" mark at step 0 (the accuracy measured before the first RL step).

    Takes lists of int / float; returns ``ax``. Raises KeyError for a key outside :data:`CURVES`.
    Source: the paper's training-curve figures; matplotlib's ``Axes.plot`` / ``annotate``."""
    many = len(lines) > 1
    for i, (label, xs, ys) in enumerate(lines):
        style = dict(marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)]) if many else \
            dict(marker=".", linestyle="-")
        if many:
            style.update(markersize=8 - 5 * i / max(len(lines) - 1, 1), markerfacecolor="none", alpha=0.9)
        ax.plot(list(xs), list(ys), label=label, zorder=3 + i, **style)
        if key == HELDOUT and len(xs) and xs[0] == 0 and i == 0:
            # above the point when the curve rises from it (the usual case), else below it: never on the x axis
            up = ys[0] <= statistics.median(ys)
            ax.annotate(BEFORE_RL, (0, ys[0]), xytext=(6, 5 if up else -5), textcoords="offset points", fontsize=8,
                        va="bottom" if up else "top")
            ax.margins(y=0.15)  # room for the label above the highest or below the lowest point
    ax.set_xlabel("RL step" + (" (0: before RL)" if key == HELDOUT else ""))
    ax.set_ylabel(Y_LABELS[key], fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if any(label for label, _, _ in lines):
        ax.legend(fontsize=8)
    return ax


def _draw(panels: Sequence[tuple[str, str]], lines: Mapping[str, Sequence[tuple[Optional[str], tuple, tuple]]],
          out_dir: str, all_name: str, grid: tuple[int, int]) -> list[str]:
    """One PNG per panel ``(key, title)`` (``<key with / as _>.png``) holding its ``(label, steps, values)``
    lines (:func:`draw_panel`), and ``all_name`` with every panel on a ``grid`` (rows, columns)."""
    plt = _pyplot()
    rows, cols = grid
    fig_all, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    written = []
    for ax_all, (key, title) in zip(axes.flat, panels):
        fig, ax = plt.subplots(figsize=(6, 4))
        for a in (ax, ax_all):
            draw_panel(a, key, title, lines[key])
        path = os.path.join(out_dir, key.replace("/", "_") + ".png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    fig_all.tight_layout()
    path = os.path.join(out_dir, all_name)
    fig_all.savefig(path, dpi=90)
    plt.close(fig_all)
    return written + [path]


def plot_run(run_dir: str, out_dir: str | None = None, *, summary: Optional[Mapping] = None) -> list[str]:
    """Write one PNG per curve in :data:`CURVES` plus ``curves.png`` (all panels) into ``out_dir``.

    Args:
      run_dir: a run directory with ``metrics.jsonl``, or the path of a metrics file itself.
      out_dir: where PNGs go (default ``plots/`` next to the metrics file, i.e. ``run_dir/plots``).
      summary: the trainer's summary (``heldout_acc_before`` / ``_after``, ``final_step``), merged over the
        run's ``summary.json``; see :func:`run_series`.
    Returns:
      paths of the PNG files written (curves missing from the metrics are skipped and not returned).
    Raises:
      FileNotFoundError: no metrics file; ValueError: a metrics file without any of the curves, a malformed
        metrics line (file and line named, see :func:`stapo_jax.train.metrics.read_metrics`), or an ``out_dir``
        that is an existing file.

    Str paths in and out; values plotted as float against int steps. Source: the paper's training-curve
    figures (entropy, reward, response length, held-out accuracy).
    """
    series = run_series(run_dir, summary)
    base = run_dir if os.path.isdir(run_dir) else os.path.dirname(os.path.abspath(run_dir))
    out_dir = _out_dir(out_dir or os.path.join(base, "plots"))
    if not series:
        raise ValueError(f"{run_dir}: metrics hold none of {[k for k, _ in CURVES]}")
    panels = [(k, t) for k, t in CURVES if k in series]
    return _draw(panels, {k: [(None, *zip(*series[k]))] for k, _ in panels}, out_dir, "curves.png", (2, 4))


def compare_runs(run_dirs: Sequence[str], out_dir: str | None = None,
                 labels: Optional[Sequence[str]] = None) -> list[str]:
    """Overlay several runs: per metric of :data:`CURVES` that any run holds, one PNG with one line per run
    holding it; ``comparison.png`` with every panel; ``comparison.json`` with the plotted lines
    (``{metric: [{"label", "run_dir", "steps", "values"}, ...]}``).

    Args:
      run_dirs: two or more run directories (or metrics files).
      out_dir: output directory (default ``<common parent of the runs>/compare``).
      labels: one legend label per run (default :func:`run_label`: ``<run name> (<recipe>)``).
    Returns:
      paths written: the per-metric PNGs, ``comparison.png``, ``comparison.json``.
    Raises:
      ValueError: fewer than two runs, a label count that differs from the run count, two runs with the same
        label, no metric in common use, or an ``out_dir`` that is a file. FileNotFoundError: a run without
        metrics.

    Str paths in and out; ``comparison.json`` holds int steps and float values.
    """
    if len(run_dirs) < 2:
        raise ValueError(f"comparing needs at least two runs, got {len(run_dirs)}")
    labels = list(labels) if labels is not None else [run_label(d) for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    if len(set(labels)) != len(labels):
        raise ValueError(f"two runs share a label ({labels}); name the run directories apart or pass labels")
    runs = [(label, d, run_series(d)) for label, d in zip(labels, run_dirs)]
    panels = [(k, t) for k, t in CURVES if any(k in s for _, _, s in runs)]
    if not panels:
        raise ValueError(f"none of the runs {list(run_dirs)} hold any of {[k for k, _ in CURVES]}")
    if out_dir is None:
        parents = [os.path.dirname(os.path.abspath(os.path.normpath(d))) for d in run_dirs]
        out_dir = os.path.join(os.path.commonpath(parents), "compare")
    out_dir = _out_dir(out_dir)
    lines = {k: [(label, *zip(*s[k])) for label, _, s in runs if k in s] for k, _ in panels}
    cols = min(4, len(panels))
    written = _draw(panels, lines, out_dir, "comparison.png", (-(-len(panels) // cols), cols))
    record = {k: [{"label": label, "run_dir": os.path.abspath(d), "steps": [x for x, _ in s[k]],
                   "values": [y for _, y in s[k]]} for label, d, s in runs if k in s] for k, _ in panels}
    path = os.path.join(out_dir, "comparison.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return written + [path]


def main(argv: list[str]) -> int:
    """``stapo-jax plot RUN_DIR [RUN_DIR ...] [--out DIR]``: one run's curves, or several runs overlaid.

    ``argv`` a list of str; returns 0. Raises what :func:`plot_run` / :func:`compare_runs` raise
    (ValueError, FileNotFoundError; the ``stapo-jax`` dispatcher prints them, exit 2); argparse errors exit 2.
    """
    p = argparse.ArgumentParser(prog="stapo-jax plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or their metrics.jsonl)")
    p.add_argument("--out", default=None,
                   help="output directory (default RUN_DIR/plots; for several runs, compare/ beside them)")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run (several runs)")
    a = p.parse_args(argv)
    if len(a.run_dirs) == 1:
        paths = plot_run(a.run_dirs[0], a.out)
    else:
        labels = [x.strip() for x in a.labels.split(",")] if a.labels else None
        paths = compare_runs(a.run_dirs, a.out, labels)
    for path in paths:
        print(path)
    return 0
