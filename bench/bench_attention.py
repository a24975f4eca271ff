"""Attention forward + backward: blockwise (flash-style, models.attention) vs our xla implementation (materialised
scores in causal query blocks, ``models.attention.xla_attention``) vs ``jax.nn.dot_product_attention(implementation=
"xla")`` with the same boolean segment mask (materialised [N, T, T] scores; the ``xla`` path before the query
blocks), all sides in one run.

Memory: for each T the jitted ``value_and_grad`` of ``sum(attention(q, k, v) * w)`` over q, k, v is compiled
(``jax.jit(...).lower(...).compile()``) and ``compiled.memory_analysis().temp_size_in_bytes`` (XLA's buffer
assignment: every temporary, arguments and outputs excluded) is printed for both implementations, with
ratios: blockwise T / blockwise 2K (linear growth would be T / 2K) and blockwise / xla at each T. Nothing is
run for the memory rows, so T = 16K compiles on any machine.

Time: at each ``--time-t`` (default 2048) the three functions run interleaved (a, b, c, a, ...) ``--repeats``
times after one warm-up call each; median and min..max milliseconds, the ratios blockwise / xla and jax.nn /
xla of medians (> 1: xla faster), and the largest relative gradient difference to jax.nn. The machine
(backend, device, CPU count) and the 1-minute load average before and after are printed.

Shapes: batch 1, causal, one packed row of 2 sequences plus left padding (segment ids), GQA with few heads so
compile stays fast. fp32 by default.

    .venv/bin/python bench/bench_attention.py                       # T = 2K, 4K, 8K, 16K; time at 2K
    .venv/bin/python bench/bench_attention.py --lengths 2048 --repeats 3   # quick
    .venv/bin/python bench/bench_attention.py --heads 16 --kv-heads 8 --head-dim 128 --lengths 512 \
        --time-t 256 512 1024                                       # Qwen3-0.6B heads at training lengths
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchutil import interleaved, load_line, machine_line, median, use_cli_allocator  # noqa: E402

from models.attention import dot_product_attention, segment_mask  # noqa: E402


def make_inputs(t: int, heads: int, kv_heads: int, head_dim: int, dtype, seed: int = 0):
    """q [1, T, N, H], k/v [1, T, Nkv, H], w [1, T, N, H] (zero at padding) and segment ids [1, T]: 64 padding
    tokens on the left, then two packed sequences splitting the rest."""
    g = np.random.default_rng(seed)
    q = jnp.asarray(g.normal(size=(1, t, heads, head_dim)), dtype)
    k = jnp.asarray(g.normal(size=(1, t, kv_heads, head_dim)), dtype)
    v = jnp.asarray(g.normal(size=(1, t, kv_heads, head_dim)), dtype)
    w = jnp.asarray(g.normal(size=(1, t, heads, head_dim)), dtype)
    seg = np.ones((1, t), np.int32)
    seg[0, :64] = 0
    seg[0, 64 + (t - 64) // 2:] = 2
    w = w * jnp.asarray(seg > 0, dtype)[:, :, None, None]  # padding queries' outputs are unspecified
    return q, k, v, w, jnp.asarray(seg)


def fwd_bwd(impl: str, block: int):
    """jit of (q, k, v, w, seg) -> (loss, (dq, dk, dv)) for one implementation (``"jax.nn"``: JAX's own xla
    attention with :func:`models.attention.segment_mask`)."""
    def loss(q, k, v, w, seg):
        if impl == "jax.nn":
            out = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(seg), implementation="xla")
        else:
            out = dot_product_attention(q, k, v, seg, implementation=impl, block_size=block)
        return jnp.sum(out * w)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def temp_bytes(impl: str, block: int, args) -> int:
    """XLA temporaries of the compiled forward + backward (bytes)."""
    return int(fwd_bwd(impl, block).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--time-t", type=int, nargs="+", default=[2048], help="T of the timing runs; 0 = no timing")
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    use_cli_allocator()
    print(machine_line())
    print(f"shapes: B=1 N={a.heads} Nkv={a.kv_heads} H={a.head_dim} {dtype.name}, block {a.block}, causal, "
          f"64 left-padding tokens + 2 packed sequences")
    rows = {}
    print(f"{'T':>6} {'xla temp MB':>12} {'blockwise MB':>13} {'bw/xla':>8} {'bw T/bw first':>14}")
    for t in a.lengths:
        args = make_inputs(t, a.heads, a.kv_heads, a.head_dim, dtype)
        x = temp_bytes("xla", a.block, args)
        b = temp_bytes("blockwise", a.block, args)
        rows[t] = (x, b)
        first = rows[a.lengths[0]][1]
        print(f"{t:>6} {x / 2**20:>12.1f} {b / 2**20:>13.2f} {b / x:>8.4f} {b / first:>14.2f}")
    out = {"temp_bytes": rows}
    out["time"] = {}
    for t in [t for t in a.time_t if t]:
        args = make_inputs(t, a.heads, a.kv_heads, a.head_dim, dtype)
        fns = {name: fwd_bwd(name, a.block) for name in ("blockwise", "xla", "jax.nn")}
        ref = fns["jax.nn"](*args)
        err = {name: max(float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))) for g, r in zip(f(*args)[1], ref[1]))
               for name, f in fns.items() if name != "jax.nn"}
        times = interleaved({name: (lambda f=f: jax.block_until_ready(f(*args))) for name, f in fns.items()},
                            a.repeats)
        med = {name: median(ts) for name, ts in times.items()}
        spread = ", ".join(f"{name} {med[name] * 1e3:.1f} ms [{min(ts) * 1e3:.1f}..{max(ts) * 1e3:.1f}]"
                           for name, ts in times.items())
        print(f"time fwd+bwd at T={t} ({a.repeats} interleaved repeats, median [min..max]): {spread}; "
              f"blockwise/xla = {med['blockwise'] / med['xla']:.2f}, jax.nn/xla = {med['jax.nn'] / med['xla']:.2f}; "
              f"max rel grad diff to jax.nn: xla {err['xla']:.1e}, blockwise {err['blockwise']:.1e}")
        out["time"][t] = med
    print(load_line("at end"))
    return out


if __name__ == "__main__":
    main()
