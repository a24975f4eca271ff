"""Rollouts in a multi-controller job: one sampler replica per JAX process, global results on every process.

Layout (DESIGN.md "Rollout layout across processes"): every process runs its own
:class:`~stapo_jax.rollout.driver.RolloutDriver` over its *local* devices, so no decode step talks to another
host. :class:`MultiHostRollout.generate` receives the same global prompt list on every process, gives process
``p`` of ``N`` a contiguous share of whole prompts (a group of G samples never straddles processes), samples it
with the global row offset (row ``r`` of the global batch always draws from the random stream of sample ``r``,
see ``RolloutDriver.generate(row_offset=)``), then all-gathers the token ids, lengths and log-probs, so every
process returns the same :class:`~stapo_jax.rollout.driver.RolloutBatch` a single process would sample.
Reward scoring is split the same way (:func:`score_rows`). Weight sync gathers the trainer's global
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
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from stapo_jax.rollout.driver import assemble_batch, check_generation_args, validate_prompts

__all__ = ["MultiHostRollout", "allgather_rows", "coordination_seconds", "localize_tree", "prompt_share",
           "score_rows"]

_COORD = {"s": 0.0}  # seconds spent in cross-process gathers since the last coordination_seconds(reset=True)


def coordination_seconds(reset: bool = False) -> float:
    """Wall seconds this process spent in the cross-process all-gathers of this module (and of
    :func:`allgather_rows` callers) since the last reset; the trainer logs it as ``time/coordination``.

    ``reset=True`` returns the running total and sets it back to 0. Returns a Python float scalar (seconds; no
    arrays, no collective). Never raises. Source: verl's ``timing_raw`` per-phase timers (``timing/*``)."""
    s = _COORD["s"]
    if reset:
        _COORD["s"] = 0.0
    return s


def prompt_share(num_prompts: int, process_index: int, process_count: int) -> tuple[int, int]:
    """Contiguous prompt range ``[lo, hi)`` of one process: the first ``num_prompts % process_count``
    processes get one prompt more (uneven shares allowed; a share may be empty). Takes and returns Python ints
    (``hi - lo`` is the share's prompt count). Source: the ``torch.utils.data.DistributedSampler`` /
    ``numpy.array_split`` convention of contiguous near-equal shares, here without padding or duplication.

    Raises:
      ValueError: ``process_index`` outside ``[0, process_count)`` or a negative ``num_prompts``.
    """
    if not 0 <= process_index < process_count or num_prompts < 0:
        raise ValueError(f"prompt_share({num_prompts}, {process_index}, {process_count}): bad arguments")
    base, extra = divmod(num_prompts, process_count)
    lo = process_index * base + min(process_index, extra)
    return lo, lo + base + (process_index < extra)


def allgather_rows(local: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """Concatenate every process's rows in process order.

    Args:
      local: this process's rows, shape ``[counts[jax.process_index()], ...]`` (any dtype, same trailing shape
        on every process).
      counts: rows of every process (identical list on every process).
    Returns:
      ``[sum(counts), ...]`` numpy array of ``local``'s dtype, identical on every process. One process:
      ``local`` itself. A collective: every process must call it at the same point with the same ``counts``.
    Raises:
      what ``multihost_utils.process_allgather`` raises when the processes disagree on the trailing shape or
      dtype, or when a peer died (the JAX distributed service aborts after the heartbeat timeout).
    Source: ``jax.experimental.multihost_utils.process_allgather(tiled=False)``, padded to ``max(counts)``
    rows since it needs the same shape on every process.
    """
    if jax.process_count() == 1:
        return np.asarray(local)
    t0 = time.perf_counter()
    width = max(max(counts), 1)
    padded = np.zeros((width,) + local.shape[1:], local.dtype)
    padded[:len(local)] = local
    gathered = np.asarray(multihost_utils.process_allgather(padded, tiled=False))  # [P, width, ...]
    _COORD["s"] += time.perf_counter() - t0
    return np.concatenate([gathered[p, :c] for p, c in enumerate(counts)])


def allgather_max(value: float) -> float:
    """The maximum of a scalar over all processes (e.g. a "stop requested" flag); ``value`` with one process.

    ``value``: a Python float (sent as a float64 ``[1]`` array); returns a Python float scalar, identical on every
    process. A collective: every process must call it at the same point. Raises what
    ``multihost_utils.process_allgather`` raises (a dead peer: the JAX distributed service aborts the process
    after the heartbeat timeout). Source: ``jax.experimental.multihost_utils.process_allgather``; the same
    agreement as ``multihost_utils.reached_preemption_sync_point`` (Orbax / MaxText preemption handling)."""
    if jax.process_count() == 1:
        return float(value)
    t0 = time.perf_counter()
    out = float(np.max(multihost_utils.process_allgather(np.asarray([value], np.float64))))
    _COORD["s"] += time.perf_counter() - t0
    return out


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
    _COORD["s"] += time.perf_counter() - t0
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


def score_rows(texts: Sequence[str], golds: Sequence[Any], scorer, group_size: int = 1) -> tuple[np.ndarray, dict]:
    """``scorer.score(texts, golds)`` with the rows split over processes (contiguous shares of whole groups of
    ``group_size`` rows), scores all-gathered; stats (``n``, ``n_correct``, ``n_timeout``, ``n_error``,
    ``n_unparsed``, ``n_pool_restarts``) summed and ``accuracy`` recomputed. One process: a direct call.

    Returns:
      (scores float32 [N], stats: str -> float) identical on every process, ``N = len(texts)``.
    Raises:
      what ``scorer.score`` raises, and the all-gather's error when a peer died (heartbeat timeout).
    Source: verl's reward manager scores every row of the batch; here each process grades its share.
    """
    n_proc, me = jax.process_count(), jax.process_index()
    if n_proc == 1:
        return scorer.score(list(texts), list(golds))
    n_groups = len(texts) // group_size
    shares = [prompt_share(n_groups, p, n_proc) for p in range(n_proc)]
    lo, hi = (s * group_size for s in shares[me])
    counts = [(b - a) * group_size for a, b in shares]
    keys = ("n", "n_correct", "n_timeout", "n_error", "n_unparsed", "n_pool_restarts")
    if hi > lo:
        scores, stats = scorer.score(list(texts[lo:hi]), list(golds[lo:hi]))
        bits = np.ascontiguousarray(np.asarray(scores, np.float32)).view(np.int32)[:, None]
        local = np.concatenate([bits, np.zeros((hi - lo, len(keys)), np.int32)], axis=1)
        local[0, 1:] = [int(stats.get(k, 0)) for k in keys]  # this share's counts ride on its first row
    else:
        local = np.zeros((0, 1 + len(keys)), np.int32)
    allrows = allgather_rows(local, counts)  # int32 so the float32 score bits travel exactly
    totals = allrows[:, 1:].astype(np.int64).sum(0)
    stats = {k: float(v) for k, v in zip(keys, totals)}
    stats["accuracy"] = stats["n_correct"] / max(stats["n"], 1.0)
    out = np.ascontiguousarray(allrows[:, 0]).view(np.float32)
    stats["score_mean"] = float(out.mean()) if out.size else 0.0
    return out, stats
