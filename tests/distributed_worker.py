"""Worker program of tests/test_distributed.py: a few data-parallel training steps of a tiny Qwen3 on a
(data, fsdp) mesh over all devices of all processes, started through ``stapo_jax.distributed.initialize``.

Usage: ``python tests/distributed_worker.py OUT.npz`` with ``JAX_COORDINATOR_ADDRESS`` /
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` set (or none of them for a single process) and
``XLA_FLAGS=--xla_force_host_platform_device_count=K``. Process 0 writes the final parameters (gathered
from every process) and the per-step losses to OUT.npz.

The step is the token-mean policy-gradient surrogate of stapo_jax.objectives' convention expressed as a
plain next-token log-likelihood weighted by per-sequence advantages (REINFORCE at ratio 1), with the global
token count as denominator, then an SGD update: a pure function ``(params, batch) -> (params, loss)``
jitted with explicit in/out shardings. Nothing here depends on the process count except the device layout.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from stapo_jax import distributed  # noqa: E402

STEPS, LR, BATCH, PROMPT, RESPONSE = 3, 0.5, 8, 6, 10


def main(out_path: str) -> int:
    info = distributed.initialize()
    from models.qwen3 import Qwen3, Qwen3Config
    from models.sharding import make_mesh, param_shardings
    from stapo_jax.policy import response_log_probs_and_entropy

    mesh = make_mesh(data=2, fsdp=-1, tensor=1)  # all devices of all processes
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    graphdef, state = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))  # same seed on every process
    p_shard = param_shardings(state, mesh)
    state = jax.device_put(state, p_shard)

    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, size=(BATCH, PROMPT + RESPONSE)).astype(np.int32)
    mask = np.ones_like(ids, dtype=bool)
    mask[:, PROMPT + 4:] = rng.random((BATCH, RESPONSE - 4)) < 0.5  # ragged responses
    mask[:, PROMPT:] = np.cumprod(mask[:, PROMPT:], axis=1).astype(bool)
    adv = rng.standard_normal(BATCH).astype(np.float32)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    rows2 = NamedSharding(mesh, P(("data", "fsdp"), None))

    def global_array(x, sharding):  # each process supplies only its devices' rows
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    batch = (global_array(ids, rows2), global_array(mask, rows2), global_array(adv, rows))

    def step(state, batch):
        ids, mask, adv = batch
        resp_mask = mask[:, PROMPT:].astype(jnp.float32)

        def loss_fn(st):
            model = nnx.merge(graphdef, st)
            lp, _ = response_log_probs_and_entropy(model, ids, mask, RESPONSE, seq_chunk=4)
            return -jnp.sum(adv[:, None] * lp * resp_mask) / jnp.maximum(jnp.sum(resp_mask), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(state)
        return jax.tree.map(lambda p, g: p - LR * g, state, grads), loss

    jstep = jax.jit(step, in_shardings=(p_shard, (rows2, rows2, rows)), out_shardings=(p_shard, None),
                    donate_argnums=(0,))
    losses = []
    with jax.set_mesh(mesh):
        for _ in range(STEPS):
            state, loss = jstep(state, batch)
            losses.append(float(loss))
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(state)[0]}
    host = multihost_utils.process_allgather(flat, tiled=True)
    if info.process_index == 0:
        np.savez(out_path, losses=np.asarray(losses), process_count=info.process_count,
                 device_count=info.device_count, **{f"param{k}": np.asarray(v) for k, v in host.items()})
    multihost_utils.sync_global_devices("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
