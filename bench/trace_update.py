"""Where the time of one update step goes, measured: a ``jax.profiler`` trace of the trainer's jitted update
(``make_train_step``, STAPO recipe, AdamW, as ``bench_update.py`` builds it), its XLA ops summed by kind, and the
kernel time and page faults of each step.

``profile_update.py`` counts FLOPs and bytes (load-independent, compile only); this script times the compiled
ops. It runs ``--steps`` untraced steps (the first compiles and warms up) printing, per step, the wall time, the
process's user / system CPU seconds and its minor page faults (``resource.getrusage``: a step that page-faults
its temporaries in shows several seconds of system time, see ``stapo_jax/runtime/allocator.py``), then traces
one more step (``jax.profiler.trace(create_perfetto_trace=True)``) and prints:

* op time (summed over XLA:CPU's worker threads, so it can exceed the wall time) by op kind: the HLO
  instruction name without its number, e.g. ``ynn_fusion`` / ``dot`` (matmuls), ``multiply_add_fusion`` (AdamW
  moments and parameter update), ``dynamic-slice_bitcast_fusion`` (the layer scan's weight slices),
  ``bitcast_dynamic-update-slice_fusion`` (the stacked layer gradients), ``copy_bitcast_fusion`` (layout
  copies, e.g. transposed activations for the weight gradients), ``wrapped_broadcast`` (zero fills);
* the ``--top`` most expensive instructions with their call count, result shape and JAX op name (from the
  compiled HLO text), which says which part of the model each one is.

    .venv/bin/python bench/trace_update.py                        # Qwen3-0.6B, all 28 layers, B=2 x (64 + 64)
    .venv/bin/python bench/trace_update.py --layers 2 --top 10    # quick
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from bench_update import OPTIM, make_batch  # noqa: E402
from benchutil import load_line, machine_line, use_cli_allocator  # noqa: E402
from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from stapo_jax.config.recipes import get_recipe  # noqa: E402
from stapo_jax.train.optim import make_optimizer  # noqa: E402
from stapo_jax.train.train_step import Batch, TrainState, make_log_prob_fn, make_train_step  # noqa: E402

WORKER = "Eigen"  # XLA:CPU's intra-op worker threads are named tf_XLAEigen/...


def op_times(trace_dir: str) -> tuple[dict, collections.Counter]:
    """``({instruction name: ms}, {instruction name: calls})`` of the XLA ops on the worker threads of the
    perfetto trace under ``trace_dir``."""
    path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ms, calls = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and WORKER in threads.get((e["pid"], e["tid"]), "") and "Execute" not in e["name"]:
            ms[e["name"]] += e["dur"] / 1e3
            calls[e["name"]] += 1
    return ms, calls


def hlo_info(hlo: str, name: str) -> tuple[str, str]:
    """(result shape, JAX op name) of the instruction ``name`` in the compiled HLO text."""
    m = re.search(rf"%{re.escape(name)} = (\S+) [^\n]*", hlo)
    if not m:
        return "?", ""
    op = re.search(r'op_name="([^"]*)"', m.group(0))
    return m.group(1), op.group(1) if op else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--P", type=int, default=64)
    ap.add_argument("--R", type=int, default=64)
    ap.add_argument("--remat", default="dots_no_batch", choices=("none", "full", "dots", "dots_no_batch"))
    ap.add_argument("--steps", type=int, default=3, help="untraced steps before the traced one (>= 2)")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    if a.steps < 2:
        raise SystemExit(f"--steps must be >= 2 (the first one compiles), got {a.steps}")
    use_cli_allocator()
    print(machine_line(), flush=True)
    base = from_hf_config("Qwen3-0.6B", dtype="float32", param_dtype="float32")
    cfg = dataclasses.replace(base, num_hidden_layers=a.layers, remat=a.remat)
    optimizer = make_optimizer(OPTIM["lr"], weight_decay=OPTIM["weight_decay"], clip_grad=OPTIM["clip_grad"],
                               betas=OPTIM["betas"], eps=OPTIM["eps"])
    state = TrainState.create(Qwen3(cfg, rngs=nnx.Rngs(0)), optimizer)
    nb = make_batch(cfg, a.B, a.P, a.R)
    ids, att = jnp.asarray(nb["input_ids"]), jnp.asarray(nb["attention_mask"])
    old_lp, old_ent = jax.jit(make_log_prob_fn(), static_argnums=(1, 4))(state.params, state.graphdef, ids, att, a.R)
    batch = Batch(input_ids=ids, attention_mask=att, response_mask=jnp.asarray(nb["response_mask"]),
                  advantages=jnp.asarray(nb["advantages"]), old_log_probs=old_lp, old_entropy=old_ent)
    step = make_train_step(get_recipe("stapo", s2t={"tau_p": 1e-9}), optimizer, vocab_size=cfg.vocab_size,
                           donate=True)
    compiled = step.lower(state, batch).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes / 2 ** 20
    print(f"shape: Qwen3-0.6B widths, L={a.layers}, B={a.B} x (P={a.P} + R={a.R}), fp32, remat {a.remat}; "
          f"XLA temporaries {temp:,.0f} MiB", flush=True)
    for i in range(a.steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        print(f"step {i}: {wall:.2f} s wall, CPU user {r1.ru_utime - r0.ru_utime:.2f} s, system "
              f"{r1.ru_stime - r0.ru_stime:.2f} s, minor page faults {r1.ru_minflt - r0.ru_minflt:,}"
              + (" (compiles, warms up)" if i == 0 else ""), flush=True)
    with tempfile.TemporaryDirectory() as trace_dir:
        t0 = time.perf_counter()
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            state, m = compiled(state, batch)
            jax.block_until_ready(m)
        wall = time.perf_counter() - t0
        ms, calls = op_times(trace_dir)
    total = sum(ms.values())
    kinds = collections.defaultdict(float)
    for name, t in ms.items():
        kinds[re.sub(r"\.\d+$", "", name)] += t
    print(f"traced step: {wall:.2f} s wall (tracing included), {total / 1e3:.2f} s of op time on the worker threads")
    for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {t:9.1f} ms {100 * t / total:5.1f} %  {kind}")
    hlo = compiled.as_text()
    print(f"top {a.top} instructions: ms, calls, result shape, JAX op name")
    for name, t in sorted(ms.items(), key=lambda kv: -kv[1])[:a.top]:
        shape, op = hlo_info(hlo, name)
        print(f"  {t:8.1f} {calls[name]:4d}  {name:42s} {shape:28s} {op[-80:]}")
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
