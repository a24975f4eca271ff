"""The figures of ``bench/gpu_check.sh``'s training stage, printed as they appear (issue 33, item 6).

``follow RUN_DIR --pid PID``: while process PID (the ``stapo-jax train`` of the stage) runs, print one line per new
step of ``RUN_DIR/metrics.jsonl`` (step time, rollout and update seconds and tokens/s, compile seconds where the
build records them), so that a stage cut short by its time limit has printed every step it finished.

``summary RUN_DIR``: the end-of-run figures of ``RUN_DIR/summary.json``: the ``steady_state`` entry (median step
seconds, rollout and update tokens/s, MFU, peak FLOP/s, chip) and the ``compile`` table (program, distinct shapes,
compiles, compile seconds, persistent-cache hits), each with a clear line when the build does not record it.

    python bench/gpu_check_report.py follow runs/gpu_check --pid 1234
    python bench/gpu_check_report.py summary runs/gpu_check
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

STEP_FIELDS = (("time/step", "step {:.2f} s"), ("time/rollout", "rollout {:.2f} s"),
               ("rollout/tokens_per_s", "{:.0f} tok/s"), ("time/update", "update {:.2f} s"),
               ("perf/tokens_per_s", "step {:.0f} tok/s"), ("perf/compile_s", "compile {:.1f} s"),
               ("perf/compiles", "({:.0f} compiles)"))
STEADY_FIELDS = ("steps", "median_step_s", "rollout_tokens_per_s", "update_tokens_per_s", "mfu", "peak_flops", "chip")
COMPILE_FIELDS = ("program", "n_shapes", "n_compiles", "compile_s", "cache_hits")


def step_line(row: dict) -> str:
    """One metrics.jsonl row as ``"step N: step 1.23 s, rollout ..."`` (fields the row lacks are left out)."""
    parts = [fmt.format(row[k]) for k, fmt in STEP_FIELDS if isinstance(row.get(k), (int, float))]
    return f"train step {row.get('step', '?')}: " + ", ".join(parts)


def alive(pid: int) -> bool:
    """True while process ``pid`` exists (and is not a zombie we could reap)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def follow(run_dir: Path, pid: int, poll_s: float = 2.0) -> int:
    """Print each new step of ``run_dir/metrics.jsonl`` until ``pid`` exits; returns the steps printed."""
    path, done, seen = run_dir / "metrics.jsonl", False, 0
    while not done:
        done = not alive(pid)  # read once more after the process ends
        if path.exists():
            lines = path.read_text().splitlines()
            for line in lines[seen:]:
                try:
                    print(step_line(json.loads(line)), flush=True)
                except json.JSONDecodeError:  # a line being written: read it at the next poll
                    break
                seen += 1
        if not done:
            time.sleep(poll_s)
    return seen


def summary(run_dir: Path) -> None:
    """Print the steady-state figures and the compile table of ``run_dir/summary.json`` (or why there are none)."""
    path = run_dir / "summary.json"
    if not path.exists():
        print(f"train summary: no {path} (the run was cut short or failed): the step lines above are what it measured")
        return
    s = json.loads(path.read_text())
    steady = s.get("steady_state")
    if isinstance(steady, dict):
        print("train steady state: " + ", ".join(f"{k} {steady[k]}" for k in STEADY_FIELDS if k in steady))
    else:
        print("train steady state: summary.json has no 'steady_state' entry (not recorded by this build)")
    table = s.get("compile")
    if isinstance(table, list):
        total = sum(float(r.get("compile_s", 0) or 0) for r in table)
        print(f"train compile: {len(table)} programs, {total:.1f} s in all")
        for r in table:
            print("  compile " + ", ".join(f"{k} {r[k]}" for k in COMPILE_FIELDS if k in r))
    else:
        print("train compile: summary.json has no 'compile' entry (compile accounting not recorded by this build)")


def main(argv=None) -> int:
    """``follow RUN_DIR`` prints each metrics.jsonl row as it lands; ``summary RUN_DIR`` prints summary.json's
    steady state and compile table. argv: str arguments; returns the exit status (int)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("follow", "summary"))
    p.add_argument("run_dir", type=Path)
    p.add_argument("--pid", type=int, default=0, help="follow: the training process")
    a = p.parse_args(argv)
    if a.command == "follow":
        if a.pid <= 0:
            raise SystemExit("follow needs --pid (the stapo-jax train process)")
        follow(a.run_dir, a.pid)
    else:
        summary(a.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
