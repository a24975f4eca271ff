"""PNG training curves from a run's ``metrics.jsonl`` (``stapo-jax plot RUN_DIR`` or ``stapo-jax plot
RUN_DIR/metrics.jsonl``)."""
from __future__ import annotations

import argparse
import os

from stapo_jax.metrics import read_metrics

# (metric key, panel title); the four curves the paper's figures show
CURVES = (("reward/mean", "reward"), ("entropy", "entropy (nats)"),
          ("s2t/masked_frac", "spurious (silenced) fraction"), ("response_length/mean", "response length (tokens)"),
          ("val/acc", "held-out accuracy (greedy)"), ("acc/mean", "rollout accuracy"))


def plot_run(run_dir: str, out_dir: str | None = None) -> list[str]:
    """Write one PNG per curve in :data:`CURVES` plus ``curves.png`` (all panels) into ``out_dir``.

    Args:
      run_dir: a run directory with ``metrics.jsonl``, or the path of a metrics file itself.
      out_dir: where PNGs go (default ``plots/`` next to the metrics file, i.e. ``run_dir/plots``).
    Returns:
      paths of the PNG files written (curves missing from the metrics are skipped and not returned).
    Raises:
      FileNotFoundError: no metrics file; ValueError: a metrics file without any of the curves, a malformed
        metrics line (file and line named, see :func:`stapo_jax.metrics.read_metrics`), or an ``out_dir``
        that is an existing file.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    base = run_dir if os.path.isdir(run_dir) else os.path.dirname(os.path.abspath(run_dir))
    out_dir = out_dir or os.path.join(base, "plots")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"plot output directory {out_dir} is an existing file, not a directory")
    os.makedirs(out_dir, exist_ok=True)
    series = {}
    for key, _ in CURVES:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            series[key] = pts
    if not series:
        raise ValueError(f"{run_dir}: metrics hold none of {[k for k, _ in CURVES]}")
    written = []
    fig_all, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax_all, (key, title) in zip(axes.flat, CURVES):
        if key not in series:
            ax_all.set_visible(False)
            continue
        xs, ys = zip(*series[key])
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for a in (ax, ax_all):
            a.plot(xs, ys, marker=".")
            a.set_xlabel("step")
            a.set_title(title)
            a.grid(alpha=0.3)
        path = os.path.join(out_dir, key.replace("/", "_") + ".png")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    fig_all.tight_layout()
    path = os.path.join(out_dir, "curves.png")
    fig_all.savefig(path, dpi=90)
    plt.close(fig_all)
    written.append(path)
    return written


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="stapo-jax plot", description=__doc__)
    p.add_argument("run_dir", help="a run directory, or its metrics.jsonl file")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/plots)")
    a = p.parse_args(argv)
    for path in plot_run(a.run_dir, a.out):
        print(path)
    return 0
