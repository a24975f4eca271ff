"""Worker program of tests/runtime/test_distributed.py: a few STAPO updates (``stapo_jax.train.train_step.make_train_step``:
S2T pre-pass with the global entropy quantile, 2 micro-batches, AdamW) of a tiny Qwen3 on a (data, fsdp) mesh over
all devices of all processes (``$STAPO_TEST_MESH``: another ``data,fsdp,tensor``), started through
``stapo_jax.runtime.distributed.initialize``.

Usage: ``python tests/distributed_worker.py OUT.npz`` with ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` set (or none of them for a single process) and
``XLA_FLAGS=--xla_force_host_platform_device_count=K``. Process 0 writes the final parameters (gathered
from every process) and the per-update metrics to OUT.npz. Every process builds the same model (same seed)
and supplies only its own devices' rows of the batch (``jax.make_array_from_callback``).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from stapo_jax.runtime import distributed  # noqa: E402

UPDATES, BATCH, PROMPT, RESPONSE, MICRO = 3, 8, 6, 10, 2
METRICS = ("loss", "grad_norm", "s2t/tau_h", "s2t/n_keep", "entropy", "pg_clipfrac")


def main(out_path: str) -> int:
    info = distributed.initialize()
    from models.qwen3 import Qwen3
    from models.qwen3_config import Qwen3Config
    from models.sharding import make_mesh
    from stapo_jax.train.optim import make_optimizer
    from stapo_jax.config.recipes import get_recipe
    from stapo_jax.train.train_step import Batch, TrainState, batch_sharding, make_log_prob_fn, make_train_step

    # all devices of all processes; STAPO_TEST_MESH="data,fsdp,tensor" picks another mesh (e.g. "1,2,2")
    data, fsdp, tensor = (int(x) for x in os.environ.get("STAPO_TEST_MESH", "2,-1,1").split(","))
    mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))  # same seed on every process
    opt = make_optimizer(lr=0.01, warmup_steps=0, weight_decay=0.1, clip_grad=1.0)
    # tau_p above 1/|V| so the S2T mask silences some tokens of this near-uniform tiny model
    recipe = get_recipe("stapo", s2t={"tau_p": 0.03})
    with jax.set_mesh(mesh):
        state = TrainState.create(model, opt, mesh)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step = make_train_step(recipe, opt, num_micro_batches=MICRO, seq_chunk=4, vocab_size=cfg.vocab_size,
                               mesh=mesh, state_shardings=shardings)

    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, size=(BATCH, PROMPT + RESPONSE)).astype(np.int32)
    att = np.ones_like(ids, dtype=bool)
    att[:, :2] = rng.random((BATCH, 2)) < 0.5  # left-padded prompts
    resp = np.cumprod(rng.random((BATCH, RESPONSE)) < 0.9, axis=1).astype(np.int32)
    resp[:, 0] = 1
    att[:, PROMPT:] = resp.astype(bool)
    adv = rng.standard_normal(BATCH).astype(np.float32)
    bs = batch_sharding(mesh)

    def global_array(x):  # each process supplies only its own devices' rows
        return jax.make_array_from_callback(x.shape, bs, lambda idx: x[idx])

    with jax.set_mesh(mesh):
        lp_fn = jax.jit(make_log_prob_fn(seq_chunk=4, num_micro_batches=MICRO), static_argnums=(1, 4))
        old_lp, _ = lp_fn(state.params, state.graphdef, global_array(ids), global_array(att), RESPONSE)
        batch = Batch(input_ids=global_array(ids), attention_mask=global_array(att),
                      response_mask=global_array(resp), advantages=global_array(adv), old_log_probs=old_lp)
        history = {k: [] for k in METRICS}
        for _ in range(UPDATES):
            state, metrics = step(state, batch)
            for k in METRICS:
                history[k].append(float(metrics[k]))
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    host = multihost_utils.process_allgather(flat, tiled=True)
    if info.process_index == 0:
        np.savez(out_path, process_count=info.process_count, device_count=info.device_count,
                 valid_tokens=int(resp.sum()),
                 **{f"metric/{k}": np.asarray(v) for k, v in history.items()},
                 **{f"param{k}": np.asarray(v) for k, v in host.items()})
    multihost_utils.sync_global_devices("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
