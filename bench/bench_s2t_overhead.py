"""S2T overhead over plain GRPO in a full update step (stapo_jax.train_step) on a tiny Qwen3, one process.

Variants: ``stapo`` (mini-batch pre-pass, current-policy stats: one extra forward), ``stapo`` with
``quantile_scope=microbatch`` (no pre-pass), ``stapo`` with ``stats_policy=old`` (stats from the old-log-prob
pass), each timed against ``justrl`` (the same loss without the mask). Goal (issue 3): <= 3 %.

    .venv/bin/python bench/bench_s2t_overhead.py [--B 16 --P 16 --R 112 --layers 2 --K 2]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.qwen3 import Qwen3, Qwen3Config
from stapo_jax.recipes import get_recipe
from stapo_jax.train_step import Batch, TrainState, make_log_prob_fn, make_train_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--P", type=int, default=16)
    ap.add_argument("--R", type=int, default=112)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=a.hidden // 4, max_position_embeddings=a.P + a.R)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    t = a.P + a.R
    ids = jnp.asarray(rng.integers(1, a.vocab, (a.B, t)), jnp.int32)
    att = jnp.ones((a.B, t), bool)
    resp = jnp.asarray(np.arange(a.R)[None] < rng.integers(a.R // 2, a.R + 1, a.B)[:, None])
    graphdef, params = nnx.split(model)
    old, old_ent = make_log_prob_fn()(params, graphdef, ids, att, a.R)
    batch = Batch(input_ids=ids, attention_mask=att, response_mask=resp,
                  advantages=jnp.asarray(rng.normal(size=a.B), jnp.float32), old_log_probs=old, old_entropy=old_ent)
    opt = optax.adamw(1e-6)

    variants = {"justrl (no mask)": get_recipe("justrl"),
                "stapo minibatch pre-pass": get_recipe("stapo"),
                "stapo microbatch scope": get_recipe("stapo", s2t={"quantile_scope": "microbatch"}),
                "stapo stats_policy=old": get_recipe("stapo", s2t={"stats_policy": "old"})}
    state = TrainState.create(model, opt)
    steps = {}
    for label, recipe in variants.items():
        steps[label] = make_train_step(recipe, opt, num_micro_batches=a.K, seq_chunk=64)
        jax.block_until_ready(steps[label](state, batch))  # compile
    best = {label: float("inf") for label in steps}
    for _ in range(a.reps):  # interleaved rounds, best of reps: robust to load from other processes
        for label, step in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, batch))
            best[label] = min(best[label], time.perf_counter() - t0)
    base = best["justrl (no mask)"]
    print(f"backend={jax.default_backend()} B={a.B} T={t} layers={a.layers} hidden={a.hidden} V={a.vocab} K={a.K}: "
          f"justrl (no mask) {base * 1e3:.1f} ms/step (best of {a.reps}, interleaved)")
    for label, t_ in best.items():
        if label != "justrl (no mask)":
            print(f"{label:28s} {t_ * 1e3:.1f} ms/step, overhead {100 * (t_ / base - 1):+.1f}% (goal <= 3%)")


if __name__ == "__main__":
    main()
