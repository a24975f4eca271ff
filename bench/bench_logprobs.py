"""Chunked vs naive log-prob + entropy from hidden states: compiled peak memory (XLA memory analysis) at
V=151,936, T=4,096, D=1,024, B=1, and wall time (forward and forward+backward), both sides in one process.

    .venv/bin/python bench/bench_logprobs.py                    # memory at full size, time at --time-T
    .venv/bin/python bench/bench_logprobs.py --time-T 4096      # full-size timing (accelerator)
    .venv/bin/python bench/bench_logprobs.py --vocab-chunk 0 --seq-chunk 128 --time-T 0   # vocab_chunk=None

Goals (issue 3): chunked peak memory <= 1/8 of naive, time <= 1.3x naive.

The chunked side runs with the default ``max_saved_logits_bytes`` (``SAVED_LOGITS_BYTES``, 512 MiB): its backward
keeps the float32 logits when B·T·V·4 bytes fit (the timing run's T=256: 148 MiB) and recomputes them otherwise
(the memory run's T=4,096: 2.3 GiB); each line says which.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchutil import interleaved, load_line, machine_line, median, ratio, summary, use_cli_allocator  # noqa: E402

from stapo_jax.algo.logprobs import logits_to_log_probs_and_entropy  # noqa: E402
from stapo_jax.algo.chunked_logprobs import SAVED_LOGITS_BYTES, chunked_log_probs_and_entropy  # noqa: E402


def naive(h, w, ids):
    return logits_to_log_probs_and_entropy(jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32), ids)


def make(seq_chunk, vocab_chunk):
    return lambda h, w, ids: chunked_log_probs_and_entropy(h, w, ids, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)


def with_grad(fn):
    """Gradient w.r.t. (hidden, lm_head_weight) of sum(log_probs) + sum(entropy), one call of ``fn``."""

    def loss(h, w, ids):
        log_probs, entropy = fn(h, w, ids)
        return jnp.sum(log_probs) + jnp.sum(entropy)

    return jax.grad(loss, argnums=(0, 1))


def kept_or_not(b, t, v) -> str:
    """Which backward the chunked side's default takes at [B, T, V] (float32 logits vs SAVED_LOGITS_BYTES)."""
    kept = b * t * v * 4 <= SAVED_LOGITS_BYTES
    return f"backward {'keeps' if kept else 'recomputes'} the logits ({b * t * v * 4 / 2**20:.0f} MiB vs " \
           f"{SAVED_LOGITS_BYTES / 2**20:.0f} MiB)"


def peak_bytes(fn, args):
    """(temporaries, temporaries + arguments + outputs) of the compiled function, bytes."""
    ma = jax.jit(fn).lower(*args).compile().memory_analysis()
    return ma.temp_size_in_bytes, ma.temp_size_in_bytes + ma.output_size_in_bytes + ma.argument_size_in_bytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--D", type=int, default=1024)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--seq-chunk", type=int, default=128)
    ap.add_argument("--vocab-chunk", type=int, default=8192, help="0: None (whole vocabulary per forward tile)")
    ap.add_argument("--time-T", type=int, default=256, help="sequence length of the timing run (CPU: small; 0 skips timing)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if a.reps < 3:
        raise SystemExit(f"--reps must be >= 3 for a median with spread (got {a.reps})")
    use_cli_allocator()
    print(machine_line(), flush=True)
    a.vocab_chunk = a.vocab_chunk or None
    chunked = make(a.seq_chunk, a.vocab_chunk)
    spec = lambda t: (jax.ShapeDtypeStruct((a.B, t, a.D), jnp.bfloat16),
                      jax.ShapeDtypeStruct((a.D, a.V), jnp.bfloat16), jax.ShapeDtypeStruct((a.B, t), jnp.int32))
    for label, n_fn, c_fn in (("forward", naive, chunked), ("fwd+bwd", with_grad(naive), with_grad(chunked))):
        (nt, n), (ct, c) = peak_bytes(n_fn, spec(a.T)), peak_bytes(c_fn, spec(a.T))
        print(f"memory {label:8s} B={a.B} T={a.T} D={a.D} V={a.V} seq_chunk={a.seq_chunk} vocab_chunk={a.vocab_chunk}:"
              f" temporaries naive {nt / 2**30:.3f} GiB, chunked {ct / 2**30:.3f} GiB, ratio {ct / nt:.3f} "
              f"(goal <= 0.125); with args+outputs naive {n / 2**30:.2f} GiB, chunked {c / 2**30:.2f} GiB, ratio "
              f"{c / n:.3f}; fits 24 GB: {c < 24e9}; {kept_or_not(a.B, a.T, a.V)}")
    if a.time_T <= 0:
        print(load_line("at end"))
        return
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    t = a.time_T
    args = (jax.random.normal(k[0], (a.B, t, a.D), jnp.bfloat16),
            (jax.random.normal(k[1], (a.D, a.V), jnp.float32) * 0.03).astype(jnp.bfloat16),
            jax.random.randint(k[2], (a.B, t), 0, a.V))
    for label, n_fn, c_fn in (("forward", naive, chunked), ("fwd+bwd", with_grad(naive), with_grad(chunked))):
        fn, fc = jax.jit(n_fn), jax.jit(c_fn)
        cpu = {}
        ts = interleaved({"naive": lambda: jax.block_until_ready(fn(*args)),
                          "chunked": lambda: jax.block_until_ready(fc(*args))}, a.reps, cpu=cpu)
        print(f"time   {label:8s} B={a.B} T={t} ({a.reps} interleaved rounds): naive {summary(ts['naive'])}, chunked "
              f"{summary(ts['chunked'])}; ratio chunked/naive = {ratio(ts['chunked'], ts['naive'])} (goal <= 1.3); "
              f"process CPU time ratio {median(cpu['chunked']) / median(cpu['naive']):.2f}; "
              f"{kept_or_not(a.B, t, a.V)}", flush=True)
    print(load_line("at end"))


if __name__ == "__main__":
    main()
