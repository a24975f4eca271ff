"""The compiler-checked paper table of docs/benchmarks.md: ``stapo-jax plan --target T --programs core`` for paper
configs on their meshes, one markdown row each (per-chip peak of the update and rollout phases, the verdict, the
rollout slots that fit, compile seconds, predicted step time, update MFU and HFU). Compiler predictions, not
measurements: no accelerator runs anything.

    python bench/paper_targets.py --out /tmp/paper                # the default pairs, compiled (about 1 h on 2 cores)
    python bench/paper_targets.py --out /tmp/paper --pairs qwen3-1.7b-base-stapo:gpu-8xh200
    python bench/paper_targets.py --out /tmp/paper --pairs qwen3-8b-base-stapo:tpu-v6e-64:rollout.max_concurrent_decodes=32
    python bench/paper_targets.py --out /tmp/paper --table-only   # rows from the JSON results already there
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stapo_jax.tools.plan_report import GB, phase_memory, predict, run_compile_seconds, slots_that_fit  # noqa: E402

# rollout slots per engine where the configs' comments say to set fewer than their default on that mesh
SLOTS = {("8b", "tpu-v5p-64"): 112, ("14b", "tpu-v5p-64"): 56, ("1.7b", "tpu-v6e-64"): 48, ("8b", "tpu-v6e-64"): 16,
         ("14b", "tpu-v6e-64"): 24, ("8b", "gpu-8xh100"): 192}


def _pair(size: str, recipe: str, target: str) -> str:
    slots = SLOTS.get((size, target))
    return f"qwen3-{size}-base-{recipe}:{target}" + (f":rollout.max_concurrent_decodes={slots}" if slots else "")


RECIPES = ("stapo", "grpo", "entropy20", "justrl")  # stapo first: the others' rollout programs come from the cache
# every paper config on the mesh its header names (8B / 14B: a v5p-64 or v6e-64 slice; 1.7B: one 8-GPU node), and
# STAPO 1.7B / 8B on both GPU nodes
DEFAULT_PAIRS = [_pair(size, recipe, target) for size in ("8b", "14b") for target in ("tpu-v5p-64", "tpu-v6e-64")
                 for recipe in RECIPES] + [_pair("1.7b", recipe, "gpu-8xh100") for recipe in RECIPES] + \
    [_pair(size, "stapo", target) for size in ("1.7b", "8b") for target in ("gpu-8xh200",)] + \
    [_pair("8b", "stapo", "gpu-8xh100")]


def row(name: str, target: str, result: dict) -> str:
    """One markdown row of a ``plan --target`` JSON result."""
    mem = phase_memory(result)
    hbm = result["spec"]["hbm_gb"]
    failed = [e for e in result["programs"] if "error" in e]

    def phase(p):
        if any(e["phase"] == p for e in failed):
            return "compile refused (OOM)" if any("RESOURCE_EXHAUSTED" in e["error"] for e in failed
                                                   if e["phase"] == p) else "failed"
        return f"{mem[p]['total'] / GB:.1f}" if p in mem else "-"

    fits = not failed and all(m["total"] <= hbm * GB for m in mem.values())
    pred = predict(result)
    compile_s = run_compile_seconds(result)
    step = f"{pred['step_s']:.0f}" if "step_s" in pred else "-"
    mfu = f"{100 * pred['update_mfu']:.0f}% / {100 * pred['update_hfu']:.0f}%" if "update_mfu" in pred else "-"
    slots = slots_that_fit(result)
    return (f"| {name} | {target} | {phase('update')} | {phase('rollout')} | {'fits' if fits else '**no**'} | "
            f"{result['spec']['decode_slots']} / {slots if slots is not None else '-'} | {compile_s:.0f} | "
            f"{step} | {mfu} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the JSON results")
    p.add_argument("--pairs", nargs="*", default=DEFAULT_PAIRS,
                   help="CONFIG:TARGET[:KEY=VALUE,...] (configs/paper/CONFIG.yaml, config overrides)")
    p.add_argument("--table-only", action="store_true", help="render the rows from JSON results already in --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| config | target | update GB/chip | rollout GB/chip | fits | slots: set / fit | compile s (run's core programs) | "
          "step s (pred.) | update MFU / HFU (pred.) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pair in args.pairs:
        name, target, *rest = pair.split(":")
        overrides = rest[0].split(",") if rest else []
        path = out / f"{name}-{target}{''.join('-' + o.rsplit('.', 1)[-1] for o in overrides)}.json"
        if not args.table_only:
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "stapo_jax.tools.plan", "--config",
                                   str(REPO / "configs" / "paper" / f"{name}.yaml"), "--mesh", target, "--target",
                                   target, "--programs", "core", "--program-cache", str(out / "program-cache"),
                                   "--json", str(path), *overrides], cwd=REPO, capture_output=True, text=True,
                                  check=False)
            path.with_suffix(".txt").write_text(proc.stdout + proc.stderr)
            print(f"<!-- {pair}: exit {proc.returncode}, {time.monotonic() - t0:.0f} s wall -->", flush=True)
        if path.is_file():
            print(row(name, target, json.loads(path.read_text())))
        else:
            print(f"| {name} | {target} | not compiled | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
