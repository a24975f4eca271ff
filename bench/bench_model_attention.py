"""Whole-model forward + backward throughput and MFU of Qwen3 shapes with each attention implementation, in one
run (sides interleaved), plus a cuDNN-vs-XLA parity line on GPU.

For each ``--models`` preset (real Qwen3 configs, random weights; ``--layers`` truncates depth so compile stays
short) and each ``--impls`` implementation, one jitted ``value_and_grad`` over all parameters of
``mean(hidden[..., :8] ** 2)`` of a ``[batch, seq]`` packed batch (two sequences per row, segment ids,
positions restarting per sequence) is compiled, then timed: ``--repeats`` rounds in which every implementation
runs once (interleaved), median and min..max per implementation.

tokens/s = batch · seq / median seconds. MFU = model FLOPs / seconds / ``--peak-tflops``, with model FLOPs of a
forward + backward = 3 x forward, forward = 2 x matmul parameters (embedding excluded, no LM head) x tokens +
causal attention 2 x 2 x L x Nh x H x seq² / 2 per row (the useful FLOPs; each implementation's own work is
not counted). Default peak: 989 TFLOP/s (H100/H200 SXM dense bf16).

On GPU the script also checks cuDNN against XLA on one layer's attention in bfloat16 (relative max difference
of outputs and gradients; bf16 rounding bounds it near 1e-2).

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


def cudnn_parity(dtype=jnp.bfloat16) -> str:
    """One attention layer (B=2, T=1024, 16/8 heads, H=128) cuDNN vs XLA: max relative differences."""
    g = np.random.default_rng(1)
    q = jnp.asarray(g.normal(size=(2, 1024, 16, 128)), dtype)
    k = jnp.asarray(g.normal(size=(2, 1024, 8, 128)), dtype)
    v = jnp.asarray(g.normal(size=(2, 1024, 8, 128)), dtype)
    seg = np.ones((2, 1024), np.int32)
    seg[0, :100] = 0
    seg[1, 600:] = 2
    seg = jnp.asarray(seg)
    w = jnp.asarray(g.normal(size=q.shape), jnp.float32) * (seg > 0)[:, :, None, None]

    def run(impl):
        f = lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, seg, implementation=impl).astype(jnp.float32) * w)
        return jax.value_and_grad(f, (0, 1, 2))(q, k, v)

    (vr, gr), (vc, gc) = run("xla"), run("cudnn")
    rel = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) / jnp.max(jnp.abs(b.astype(jnp.float32))))
           for a, b in zip(gc, gr)]
    return (f"cudnn vs xla ({jnp.dtype(dtype).name}): loss rel {abs(float(vc - vr)) / abs(float(vr)):.1e}, "
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
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    impls = (a.impls or ("cudnn,blockwise,xla" if gpu else "blockwise,xla")).split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()}); {a.dtype}, "
          f"batch {a.batch} x seq {a.seq} (2 packed sequences per row), remat {a.remat}; load(1m) "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    if gpu:
        print(cudnn_parity(), flush=True)
    results = {}
    for name in a.models.split(","):
        over = dict(dtype=a.dtype, param_dtype=a.dtype, remat=a.remat)
        if a.layers:
            over["num_hidden_layers"] = a.layers
        base = preset(name.strip(), **over)
        args = packed_batch(a.batch, a.seq, base.vocab_size)
        fns = {}
        for impl in impls:
            cfg = dataclasses.replace(base, attention=impl)
            f, state = step_fn(cfg)
            t0 = time.perf_counter()
            try:
                jax.block_until_ready(f(state, *args))
            except Exception as e:  # report an implementation that cannot run here and go on with the others
                print(f"[{name}] {impl}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            fns[impl] = (f, state, time.perf_counter() - t0)
        times = {k: [] for k in fns}
        for _ in range(a.repeats):
            for impl, (f, state, _) in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(state, *args))
                times[impl].append(time.perf_counter() - t0)
        flops = model_flops(base, a.batch, a.seq)
        for impl, ts in times.items():
            med = statistics.median(ts)
            results[(name, impl)] = med
            print(f"[{name} L={base.num_hidden_layers}] {impl:>9}: {a.batch * a.seq / med:>10.0f} tokens/s, "
                  f"MFU {flops / med / (a.peak_tflops * 1e12) * 100:5.1f}%, median {med * 1e3:.1f} ms "
                  f"[{min(ts) * 1e3:.1f}..{max(ts) * 1e3:.1f}], compile+first {fns[impl][2]:.1f} s", flush=True)
        if "xla" in times:
            ref = statistics.median(times["xla"])
            print(f"[{name}] time / xla: " + ", ".join(f"{k} {statistics.median(v) / ref:.2f}"
                                                     for k, v in times.items()), flush=True)
    return results


if __name__ == "__main__":
    main()
