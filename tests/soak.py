"""Randomized soak of the multi-process training loop (issue 34): configurations drawn from a seeded space, each
run by ``stapo-jax launch --local N --devices-per-process D`` in the layouts 2 x 2 and 4 x 1 and compared with
the 1 x 4 run of the same configuration: the same prompts, sampled tokens and rewards of every RL step
(``STAPO_DUMP_EXPERIENCE_DIR`` dumps), sampler log-probs and the final HF export within ``ATOL``, and every run
finishing within its bound (a hung run is killed and reported, never waited for).

The space: SFT warm-up steps 0-40 (0: the untrained model almost never samples EOS; 40 at lr 1e-2: early EOS),
``rollout.n``, ``rollout.max_new_tokens``, ``rollout.steps_per_sync``, ``rollout.kv_cache_buckets``, prompt
counts that do not split evenly over the processes, DAPO dynamic sampling, the recipe, at the tiny config's
``rollout.max_concurrent_decodes`` (128) unless drawn smaller.

Usage (``make soak``): ``python tests/soak.py [--configs 8] [--seed 0] [--layouts 2x2,4x1] [--out DIR]
[--timeout-s 900]``; prints one line per run and exits non-zero when a run failed, hung or differed.
``tests/runtime/test_soak.py`` runs the first configuration in 2 x 2 against 1 x 4 in the normal suite.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
ATOL = 1e-5
EXACT_KEYS = ("input_ids", "attention_mask", "response_mask", "rewards")  # per RL step, must be equal
CLOSE_KEYS = ("rollout_log_probs", "advantages")  # per RL step, within ATOL
FIXED = ["data.gym.size=96", "data.gym.val_size=6", "reward.num_workers=1", "trainer.eval_every=0",
         "trainer.save_every=0", "sft.lr=1.0e-2", "sft.batch_size=16"]


def draw_config(rng: random.Random) -> list[str]:
    """One configuration of the soak space as ``stapo-jax`` overrides (strings ``key=value``).

    ``rng``: a seeded ``random.Random`` (the draw is a pure function of its state). Every drawn batch splits into
    the 4 data-parallel shards of every layout (rows of a mini-batch a multiple of 4); the prompt count is odd or
    not a multiple of 4, so prompts never split evenly over 2 or 4 processes. Never raises. Source: this project's
    config schema (``stapo_jax.config.schema``); DAPO's dynamic sampling (``sampling.dynamic``)."""
    recipe = rng.choice(["stapo", "grpo", "dapo"])
    n = rng.choice([2, 4, 8])
    prompts = rng.choice([6, 10] if n == 2 else [3, 5, 6, 7])
    per_shard = prompts * n // 4  # rows of one of the 4 data-parallel shards
    out = [f"algorithm.recipe={recipe}", f"sft.steps={rng.randint(0, 40)}", f"rollout.n={n}",
           f"rollout.max_new_tokens={rng.choice([3, 8, 13])}", f"rollout.steps_per_sync={rng.choice([1, 2, 8])}",
           f"rollout.kv_cache_buckets={rng.choice(['true', 'false'])}",
           f"rollout.max_concurrent_decodes={rng.choice([128, 128, 24])}",
           f"trainer.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}",
           f"actor.ppo_micro_batch_size={rng.choice([d for d in range(1, per_shard + 1) if per_shard % d == 0])}",
           f"trainer.total_steps={rng.choice([1, 2])}"]
    if recipe == "dapo":
        out += ["reward.overlong_buffer_len=2"]
    elif rng.random() < 0.3:
        out += ["sampling.dynamic=true", "algorithm.strict_recipe=false"]
    return out


def draw_configs(seed: int, count: int) -> list[list[str]]:
    """``count`` configurations (override lists) drawn by ``random.Random(seed)``; the same seed gives the same
    list. Never raises. Source: :func:`draw_config`."""
    rng = random.Random(seed)
    return [draw_config(rng) for _ in range(count)]


def run_layout(n: int, devices: int, overrides: list[str], run_dir: Path, timeout_s: float) -> tuple[int, float, str]:
    """Run ``stapo-jax launch --local n --devices-per-process devices`` (train) with ``overrides`` into ``run_dir``.

    Returns ``(exit code, wall seconds, output tail)``; exit code ``-9`` with "TIMEOUT" in the tail when the run
    passed ``timeout_s`` (the whole process group is then killed with SIGKILL: a deadlocked ``jax.distributed``
    process ignores SIGTERM). Never raises for a failing run. Source: ``stapo_jax.runtime.launch``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAPO_DUMP_EXPERIENCE_DIR=str(run_dir / "dump"))
    cmd = [sys.executable, "-m", "stapo_jax", "launch", "--local", str(n), "--devices-per-process", str(devices),
           "--timeout", str(int(timeout_s)), "--config", CONFIG, *FIXED, *overrides, f"trainer.run_dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s + 60)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, rc = (proc.communicate()[0] or "") + "\nTIMEOUT", -9
    return rc, time.perf_counter() - t0, out[-4000:]


def compare_runs(ref: Path, other: Path) -> list[str]:
    """Differences between two runs' RL-step dumps and HF exports (empty list: equal).

    ``ref`` / ``other``: run directories with ``dump/step_<k>.npz`` and ``hf/model.safetensors``. Keys
    ``EXACT_KEYS`` must be equal, ``CLOSE_KEYS`` and every exported tensor within ``ATOL`` (float32). Returns
    one line per difference. Never raises for missing files (reported as a difference). Source: the
    layout-equality checks of tests/runtime/test_multihost.py."""
    from safetensors.numpy import load_file

    problems = []
    steps = sorted(p.name for p in (ref / "dump").glob("step_*.npz"))
    if not steps or steps != sorted(p.name for p in (other / "dump").glob("step_*.npz")):
        return [f"dumped steps differ or are missing: {steps}"]
    for name in steps:
        a, b = np.load(ref / "dump" / name), np.load(other / "dump" / name)
        for k in EXACT_KEYS:
            if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k]):
                problems.append(f"{name} {k} differs")
        for k in CLOSE_KEYS:
            if a[k].shape != b[k].shape or not np.allclose(a[k], b[k], rtol=0, atol=ATOL):
                problems.append(f"{name} {k} differs by more than {ATOL}")
    try:
        ea, eb = load_file(str(ref / "hf" / "model.safetensors")), load_file(str(other / "hf" / "model.safetensors"))
    except OSError as e:
        return problems + [f"export missing: {e}"]
    if sorted(ea) != sorted(eb):
        return problems + ["exported tensor names differ"]
    for k in ea:
        if ea[k].shape != eb[k].shape or not np.allclose(ea[k], eb[k], rtol=0, atol=ATOL):
            problems.append(f"export {k} differs by more than {ATOL}")
    return problems


def soak_one(overrides: list[str], out: Path, layouts=((2, 2), (4, 1)), timeout_s: float = 900) -> list[str]:
    """Run one configuration as 1 x 4 and each of ``layouts``; returns the failures (empty: all equal and in
    time), each ``"<layout>: <what>"``. Prints one line per run (layout, exit code, wall seconds).
    Never raises for a failing run. Source: :func:`run_layout`, :func:`compare_runs`."""
    failures = []
    runs = {}
    for n, d in ((1, 4), *layouts):
        rc, wall, tail = run_layout(n, d, overrides, out / f"{n}x{d}", timeout_s)
        print(f"  {n}x{d}: exit {rc} in {wall:.0f} s", flush=True)
        runs[(n, d)] = rc
        if rc != 0:
            failures.append(f"{n}x{d}: exit {rc}\n{tail[-1500:]}")
    if runs[(1, 4)] == 0:
        for layout in layouts:
            if runs[layout] == 0:
                failures += [f"{layout[0]}x{layout[1]}: {p}" for p in compare_runs(out / "1x4", out / "{}x{}".format(*layout))]
    return failures


def main(argv=None) -> int:
    """The ``make soak`` command; see the module docstring. Returns the exit code (1 when any run failed)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="skip the first FIRST drawn configurations")
    ap.add_argument("--layouts", default="2x2,4x1")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="bound of each run (seconds)")
    ap.add_argument("--out", default="runs/soak")
    args = ap.parse_args(argv)
    layouts = tuple(tuple(int(v) for v in s.split("x")) for s in args.layouts.split(","))
    t0, failed = time.perf_counter(), 0
    for i, overrides in enumerate(draw_configs(args.seed, args.configs)):
        if i < args.first:
            continue
        print(f"config {i}: {' '.join(overrides)}", flush=True)
        failures = soak_one(overrides, Path(args.out) / f"config_{i}", layouts, args.timeout_s)
        failed += bool(failures)
        print(f"config {i}: {'FAIL' if failures else 'ok'}", *failures, sep="\n  ", flush=True)
    print(f"soak: {args.configs - args.first - failed} of {args.configs - args.first} configurations passed in "
          f"{time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
