"""Whole-model forward + backward throughput and MFU of Qwen3 shapes with each attention implementation, in one
run, plus a parity line of each implementation against XLA's attention.

For each ``--models`` preset (real Qwen3 configs, random weights; ``--layers`` truncates depth so compile stays
short) and each ``--impls`` implementation, one jitted ``value_and_grad`` over all parameters of
``mean(hidden[..., :8] ** 2)`` of a ``[batch, seq]`` packed batch (two sequences per row, segment ids,
positions restarting per sequence) is compiled, then timed (``--repeats`` calls, median and min..max) and printed before the next implementation
compiles, so that a run cut short by a time limit keeps every figure it reached.

tokens/s = batch · seq / median seconds. MFU = model FLOPs / seconds / ``--peak-tflops``, with model FLOPs of a
forward + backward = 3 x forward, forward = 2 x matmul parameters (embedding excluded, no LM head) x tokens +
causal attention 2 x 2 x L x Nh x H x seq² / 2 per row (the useful FLOPs; each implementation's own work is
not counted). Default peak: 989 TFLOP/s (H100/H200 SXM dense bf16).

First, each non-XLA implementation is checked against XLA on one layer's attention in ``--dtype`` (relative max
difference of outputs and gradients; bf16 rounding bounds it near 1e-2).

    python bench/bench_model_attention.py --models Qwen3-0.6B,Qwen3-1.7B --seq 4096 --batch 2   # GPU
    python bench/bench_model_attention.py --models Qwen3-0.6B --layers 1 --seq 256 --batch 1 \\
        --impls xla,blockwise --dtype float32 --repeats 2                                       # CPU smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models.attention import dot_product_attention  # noqa: E402
from models.presets import preset  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402


def packed_batch(batch: int, seq: int, vocab: int):
    """ids, mask, segment ids, positions [batch, seq]: two sequences per row (60% / 40%), no padding."""
    g = np.random.default_rng(0)
    ids = g.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    cut = int(seq * 0.6)
    seg = np.where(np.arange(seq) < cut, 1, 2)[None].repeat(batch, 0).astype(np.int32)
    pos = np.where(np.arange(seq) < cut, np.arange(seq), np.arange(seq) - cut)[None].repeat(batch, 0)
    return (jnp.asarray(ids), jnp.ones((batch, seq), bool), jnp.asarray(seg), jnp.asarray(pos.astype(np.int32)))


def model_flops(cfg, batch: int, seq: int) -> float:
    """Useful FLOPs of one forward + backward (see the module docstring)."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nh, nkv, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    matmul = L * (d * nh * h * 2 + d * nkv * h * 2 + 3 * d * f)
    fwd = 2 * matmul * batch * seq + 2 * L * nh * h * seq * seq * batch  # causal: half of 4 · L · Nh · H · T²
    return 3.0 * fwd


def step_fn(cfg):
    graphdef, state = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))

    def loss(st, ids, mask, seg, pos):
        hidden, _ = nnx.merge(graphdef, st)(ids, mask, positions=pos, segment_ids=seg)
        return jnp.mean(hidden[..., :8].astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss)), state


def attention_parity(impl: str, dtype=jnp.bfloat16, seq: int = 1024) -> str:
    """One attention layer (B=2, T=``seq``, 16/8 heads, H=128, padding and two segments) of ``impl`` against
    XLA's: relative max differences of the loss and of dq, dk, dv (cuDNN on GPU; blockwise anywhere)."""
    g = np.random.default_rng(1)
    q = jnp.asarray(g.normal(size=(2, seq, 16, 128)), dtype)
    k = jnp.asarray(g.normal(size=(2, seq, 8, 128)), dtype)
    v = jnp.asarray(g.normal(size=(2, seq, 8, 128)), dtype)
    seg = np.ones((2, seq), np.int32)
    seg[0, : seq // 10] = 0
    seg[1, seq * 6 // 10:] = 2
    seg = jnp.asarray(seg)
    w = jnp.asarray(g.normal(size=q.shape), jnp.float32) * (seg > 0)[:, :, None, None]

    def run(impl):
        f = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, seg, implementation=impl).astype(jnp.float32) * w)
        return jax.value_and_grad(f, (0, 1, 2))(q, k, v)

    (vr, gr), (vc, gc) = run("xla"), run(impl)
    rel = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b.astype(jnp.float32))))
           for a, b in zip(gc, gr)]
    return (f"{impl} vs xla ({jnp.dtype(dtype).name}, T={seq}): loss rel {abs(float(vc - vr)) / abs(float(vr)):.1e}, "
            f"grad rel dq {rel[0]:.1e} dk {rel[1]:.1e} dv {rel[2]:.1e}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="Qwen3-0.6B,Qwen3-1.7B")
    p.add_argument("--impls", default=None, help="default: cudnn,blockwise,xla on GPU, else blockwise,xla")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="truncate to this many layers (compile time)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--remat", default="full")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the preset's; a CPU smoke takes a small one)")
    p.add_argument("--parity-seq", type=int, default=1024, help="sequence length of the one-layer parity check")
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    impls = (a.impls or ("cudnn,blockwise,xla" if gpu else "blockwise,xla")).split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); {a.dtype}, "
          f"batch {a.batch} x seq {a.seq} (2 packed sequences per row), remat {a.remat}; load(1m) "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    for impl in [i for i in impls if i != "xla"]:  # parity first: one layer, seconds to compile
        try:
            print(attention_parity(impl, jnp.dtype(a.dtype), a.parity_seq), flush=True)
        except Exception as e:  # an implementation that cannot run here is reported, the others go on
            print(f"{impl} vs xla: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    results = {}
    for name in a.models.split(","):
        over = dict(dtype=a.dtype, param_dtype=a.dtype, remat=a.remat)
        if a.layers:
            over["num_hidden_layers"] = a.layers
        if a.vocab:
            over["vocab_size"] = a.vocab
        base = preset(name.strip(), **over)
        args = packed_batch(a.batch, a.seq, base.vocab_size)
        flops = model_flops(base, a.batch, a.seq)
        times = {}
        for impl in impls:  # compile, time and print one implementation at a time: a cut run keeps what it has
            cfg = dataclasses.replace(base, attention=impl)
            f, state = step_fn(cfg)
            t0 = time.perf_counter()
            try:
                jax.block_until_ready(f(state, *args))
            except Exception as e:  # report an implementation that cannot run here and go on with the others
                print(f"[{name}] {impl}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            first = time.perf_counter() - t0
            ts = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(f(state, *args))
                ts.append(time.perf_counter() - t0)
            times[impl] = ts
            med = statistics.median(ts)
            results[(name, impl)] = med
            print(f"[{name} L={base.num_hidden_layers}] {impl:>9}: {a.batch * a.seq / med:>10.0f} tokens/s, "
                  f"MFU {flops / med / (a.peak_tflops * 1e12) * 100:5.1f}%, median {med * 1e3:.1f} ms "
                  f"[{min(ts) * 1e3:.1f}..{max(ts) * 1e3:.1f}], compile+first {first:.1f} s", flush=True)
            del f, state
        if "xla" in times:
            ref = statistics.median(times["xla"])
            print(f"[{name}] time / xla: " + ", ".join(f"{k} {statistics.median(v) / ref:.2f}"
                                                     for k, v in times.items()), flush=True)
    return results


if __name__ == "__main__":
    main()
