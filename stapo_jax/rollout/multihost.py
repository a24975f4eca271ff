"""Rollouts in a multi-controller job: one sampler replica per JAX process, global results on every process.

Layout (DESIGN.md "Multi-process runs"): every process runs its own
:class:`~stapo_jax.rollout.driver.RolloutDriver` over its *local* devices, so no decode step talks to another
host. :class:`MultiHostRollout.generate` receives the same global prompt list on every process, gives process
``p`` of ``N`` a contiguous share of whole prompts (a group of G samples never straddles processes), samples it
with the global row offset (row ``r`` of the global batch always draws from the random stream of sample ``r``,
see ``RolloutDriver.generate(row_offset=)``), then all-gathers the token ids, lengths and log-probs, so every
process returns the same :class:`~stapo_jax.rollout.driver.RolloutBatch` a single process would sample.
Reward scoring is split the same way (:func:`stapo_jax.runtime.collectives.score_rows`; the all-gathers
are in :mod:`stapo_jax.runtime.collectives`). Weight sync gathers the trainer's global
parameters (in chunks of at most ``SYNC_CHUNK_BYTES``) into a full copy on this process's devices
(:func:`localize_tree`).

With one process every function here is the identity / a direct call: single-process behaviour is unchanged.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from stapo_jax.rollout.driver import assemble_batch, check_generation_args, validate_prompts
from stapo_jax.runtime.collectives import add_coordination_seconds, allgather_rows, prompt_share

__all__ = ["MultiHostRollout", "localize_tree"]
@functools.lru_cache(maxsize=64)
def _replicate_fn(mesh, n: int):
    """A jitted identity of ``n`` arrays whose outputs are replicated over ``mesh`` (cached: compiled once per
    mesh, count and input shapes, not once per weight sync)."""
    return jax.jit(lambda *a: a, out_shardings=tuple(NamedSharding(mesh, PartitionSpec()) for _ in range(n)))


SYNC_CHUNK_BYTES = 256 * 2**20  # weight sync gathers at most this many bytes per collective (or one larger tensor)


def localize(xs: Sequence[Any], local_mesh) -> list:
    """Full copies of the global arrays ``xs`` as arrays over ``local_mesh`` (this process's devices), replicated.

    Every process must call it with the same arrays (one jitted identity whose outputs are replicated over the
    global mesh all-gathers them; this process keeps its own shards). Arrays already addressable here, and
    non-arrays, are returned as they are. Never fetches a non-addressable array to the host.

    Shapes and dtypes are kept (each output has its input's global shape and dtype, sharding
    ``NamedSharding(local_mesh, PartitionSpec())``). Raises what ``jax.jit`` raises when the arrays are not on
    one mesh, or the collective's error when a peer died (heartbeat timeout). Source: the JAX multi-controller
    resharding convention (``jax.jit(out_shardings=)`` + ``jax.make_array_from_single_device_arrays``), as
    verl's FSDP -> vLLM weight sync gathers full tensors per rollout replica.
    """
    idx = [i for i, x in enumerate(xs) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    out = list(xs)
    if not idx:
        return out
    t0 = time.perf_counter()
    reps = _replicate_fn(xs[idx[0]].sharding.mesh, len(idx))(*(xs[i] for i in idx))
    for i, rep in zip(idx, reps):
        out[i] = jax.make_array_from_single_device_arrays(
            rep.shape, NamedSharding(local_mesh, PartitionSpec()), [s.data for s in rep.addressable_shards])
    add_coordination_seconds(time.perf_counter() - t0)
    return out


def localize_tree(tree: Any, local_mesh, place: Optional[Callable[[Any, Any], Any]] = None,
                  chunk_bytes: int = SYNC_CHUNK_BYTES) -> Any:
    """:func:`localize` the leaves of ``tree`` in chunks of at most ``chunk_bytes`` (a larger tensor alone), so
    the extra device memory is one chunk; ``place(path, local)`` (optional) may move each local copy to its
    final sharding before the next chunk is gathered. Every process must call it with the same tree.

    ``tree``: a pytree of arrays (any shapes and dtypes, kept); ``chunk_bytes``: int bytes per collective.
    Returns the pytree of local replicated copies (or ``place``'s results). Raises as :func:`localize`, and
    what ``place`` raises. Source: verl's bucketed weight sync (``update_weights_bucket_megabytes``)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out, chunk, size = [], [], 0

    def flush():
        nonlocal chunk, size
        for (path, _), loc in zip(chunk, localize([x for _, x in chunk], local_mesh)):
            out.append(place(path, loc) if place is not None else loc)
        chunk, size = [], 0

    for path, leaf in leaves:
        nbytes = int(getattr(leaf, "nbytes", 0))
        if chunk and size + nbytes > chunk_bytes:
            flush()
        chunk.append((path, leaf))
        size += nbytes
    flush()
    return jax.tree_util.tree_unflatten(treedef, out)


def local_mesh(cfg_mesh=None):
    """A ``(data, fsdp, tensor)`` mesh over this process's devices: ``tensor`` = ``mesh.tensor`` of the run
    config when it divides the local device count, else 1; the other devices on ``fsdp``.

    ``cfg_mesh``: the config's ``mesh`` section (or None); returns a ``jax.sharding.Mesh`` of shape
    ``(1, local_devices / tensor, tensor)``. A ``mesh.tensor`` that does not divide the local device count
    falls back to 1 rather than raising an error. Source: JetStream / MaxEngine's one engine per host over its own
    devices."""
    from models.sharding import make_mesh

    n = jax.local_device_count()
    tensor = getattr(cfg_mesh, "tensor", 1) or 1
    tensor = tensor if tensor > 0 and n % tensor == 0 else 1
    return make_mesh(data=1, fsdp=n // tensor, tensor=tensor, devices=jax.local_devices())


class MultiHostRollout:
    """A rollout source whose ``generate`` returns the global batch on every process (module docstring).

    Args:
      driver: this process's :class:`~stapo_jax.rollout.driver.RolloutDriver` over its local devices.
      local_mesh: the driver's engine mesh (weights synced into it).
    """

    def __init__(self, driver, local_mesh):
        self.driver = driver
        self.local_mesh = local_mesh

    @property
    def engine(self):
        """This process's :class:`~stapo_jax.rollout.engine.Qwen3Engine` (the driver's)."""
        return self.driver.engine

    @property
    def pad_token_id(self) -> int:
        """The padding id (int) of the generated batches (the driver's)."""
        return self.driver.pad_token_id

    @property
    def params(self):
        """The engine's current weights on the local mesh (as last set by :meth:`sync_weights`)."""
        return self.driver.params

    def sync_weights(self, params) -> float:
        """Gather the trainer's global ``params`` chunk by chunk into this process's engine; returns seconds.
        Every process must call it."""
        t0 = time.perf_counter()
        self.driver.sync_weights(localize_tree(params, self.local_mesh))
        return time.perf_counter() - t0

    def generate(self, prompts: Sequence[Sequence[int]], *, num_samples: int = 1,
                 max_new_tokens: Optional[int] = None, seed: int = 0, sampling=None):
        """The global :class:`~stapo_jax.rollout.driver.RolloutBatch` of ``prompts`` (same on every process).

        Args/Returns/Raises: as ``RolloutDriver.generate``; ``prompts`` must be the same list on every process.
        """
        eng = self.driver.engine
        limit = eng.config.max_decode_length
        max_new_tokens = limit if max_new_tokens is None else max_new_tokens
        check_generation_args(num_samples, max_new_tokens, limit)
        prompts = validate_prompts(prompts, eng.max_prefill_length, eng.model_config.vocab_size,
                                   self.driver.prompt_truncation)
        g, n_proc, me = int(num_samples), jax.process_count(), jax.process_index()
        if n_proc == 1:
            return self.driver.generate(prompts, num_samples=g, max_new_tokens=max_new_tokens, seed=seed,
                                        sampling=sampling)
        shares = [prompt_share(len(prompts), p, n_proc) for p in range(n_proc)]
        lo, hi = shares[me]
        counts = [(b - a) * g for a, b in shares]
        if hi > lo:
            part = self.driver.generate(prompts[lo:hi], num_samples=g, max_new_tokens=max_new_tokens, seed=seed,
                                        sampling=sampling, row_offset=lo * g)
            tokens, lps, lengths = part.responses, part.rollout_log_probs, part.response_lengths
        else:
            tokens = np.zeros((0, max_new_tokens), np.int32)
            lps = np.zeros((0, max_new_tokens), np.float32)
            lengths = np.zeros((0,), np.int32)
        # one gather per batch, bit-exact: log-probs travel as the int32 view of their float32 bits
        packed = np.concatenate([tokens.astype(np.int32), np.ascontiguousarray(lps, np.float32).view(np.int32),
                                 lengths[:, None].astype(np.int32)], axis=1)
        allrows = allgather_rows(packed, counts)
        m = max_new_tokens
        tokens, lengths = allrows[:, :m], allrows[:, 2 * m].astype(np.int64)
        lps = np.ascontiguousarray(allrows[:, m:2 * m]).view(np.float32)
        rows = [tokens[r, :n] for r, n in enumerate(lengths)]
        row_lps = [lps[r, :n] for r, n in enumerate(lengths)]
        return assemble_batch(prompts, g, max_new_tokens, rows, row_lps, eng.eos_token_ids, self.driver.pad_token_id)
