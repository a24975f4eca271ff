"""Wall time of the tiny run as N processes x D devices against 1 process x N*D, and the seconds per RL step
spent on cross-process coordination (the trainer's ``time/coordination``: the all-gathers of rollout results,
scores and the SIGTERM flag, and the weight-sync gathers; docs/benchmarks.md, "Multi-process layouts").

``python bench/multihost_layouts.py [--layouts 1x4,2x2] [--repeats 1] [--steps 3] [--sft-steps 40]`` runs
``stapo-jax launch --local N --devices-per-process D train`` on ``configs/tiny_cpu.yaml`` with the settings of
``tests/runtime/test_multihost.py`` (SFT warm-up, held-out evaluation of 6 problems before and after, RL steps of 4
prompts x 4 samples, checkpoints, HF export) once per layout and repeat, the layouts interleaved, and prints per
layout the median wall time (start-up and compiles included), the median ``time/step`` and
``time/coordination`` / ``time/sync`` of the RL steps after the first (step 1 holds the compiles), and the ratio
of every layout's wall time to the first layout's. CPU only; on a shared machine the absolute times are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overrides(steps: int, sft_steps: int) -> list[str]:
    """The ``tests/runtime/test_multihost.py`` run (``OVERRIDES`` there), with ``steps`` RL and ``sft_steps`` SFT steps."""
    return [f"sft.steps={sft_steps}", "sft.lr=1.0e-2", "sft.batch_size=16", f"trainer.total_steps={steps}",
            "trainer.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            "actor.ppo_micro_batch_size=2", "trainer.eval_every=0", "trainer.save_every=1",
            "rollout.max_concurrent_decodes=16", "data.gym.size=64", "data.gym.val_size=6", "reward.num_workers=1"]


def run_layout(n: int, d: int, run_dir: str, args: list[str]) -> dict:
    """One launched run; returns its wall seconds and the metrics rows of process 0 (RuntimeError on failure)."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "stapo_jax", "launch", "--local", str(n), "--devices-per-process", str(d),
           "--timeout", "1800", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"), *args,
           f"trainer.run_dir={run_dir}"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=2000)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"{n}x{d} exited {r.returncode}:\n{r.stdout[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"wall_s": wall, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1x4,2x2", help="comma-separated NxD; the first is the reference")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="RL steps (>= 2: step 1 holds the compiles)")
    ap.add_argument("--sft-steps", type=int, default=40)
    a = ap.parse_args()
    layouts = [tuple(int(v) for v in x.split("x")) for x in a.layouts.split(",")]
    tmp = tempfile.mkdtemp(prefix="multihost_layouts_")
    runs: dict[tuple, list[dict]] = {x: [] for x in layouts}
    for rep in range(a.repeats):
        for n, d in layouts:  # interleaved, so a load change on the machine hits every layout alike
            runs[(n, d)].append(run_layout(n, d, os.path.join(tmp, f"{n}x{d}_{rep}"),
                                           overrides(a.steps, a.sft_steps)))
    med = statistics.median
    ref_wall = med(r["wall_s"] for r in runs[layouts[0]])
    print(f"tiny run: SFT {a.sft_steps} steps, {a.steps} RL steps, {a.repeats} repeat(s); medians; RL step "
          f"figures over steps 2..{a.steps}")
    print("| layout | wall s | wall / first layout | time/step s | time/coordination s | time/sync s |")
    print("|---|---|---|---|---|---|")
    for n, d in layouts:
        rs = runs[(n, d)]
        later = [row for r in rs for row in r["rows"][1:]]
        wall = med(r["wall_s"] for r in rs)
        cols = [med(row.get(k, 0.0) for row in later) for k in ("time/step", "time/coordination", "time/sync")]
        print(f"| {n} process(es) x {d} device(s) | {wall:.1f} | {wall / ref_wall:.2f}x | {cols[0]:.3f} | "
              f"{cols[1]:.4f} | {cols[2]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
