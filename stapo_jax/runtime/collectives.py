"""Collectives of a multi-controller job: the cross-process all-gathers the training loop, the rollout and the
reward scoring share, and the clock of the time spent in them.

* :func:`allgather_rows` / :func:`allgather_max`: every process's rows, or the maximum of a scalar, on every process;
* :func:`stop_requested`: whether a stop signal reached any process (all stop after the same step);
* :func:`prompt_share`: a process's contiguous share of whole prompts (or groups);
* :func:`score_rows`: reward scoring split over processes, scores all-gathered;
* :func:`coordination_seconds` / :func:`add_coordination_seconds`: the wall time spent in these collectives (logged
  as ``time/coordination``).

With one process every function here is the identity / a direct call: single-process behaviour is unchanged.
The rollout-specific parts (one sampler per process, weight sync) are in :mod:`stapo_jax.rollout.multihost`.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["add_coordination_seconds", "allgather_max", "allgather_rows", "coordination_seconds", "prompt_share",
           "score_rows", "stop_requested"]

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


def add_coordination_seconds(seconds: float) -> None:
    """Add ``seconds`` (a Python float, wall seconds one cross-process collective took) to the total
    :func:`coordination_seconds` returns; for collectives defined outside this module (the rollout's weight sync).
    Never raises. Source: verl's ``timing_raw`` per-phase timers (``timing/*``)."""
    _COORD["s"] += seconds


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


def stop_requested(preempt) -> bool:
    """True on every process when SIGTERM or SIGINT (``preempt``: a ``runtime.stopping.Preemption``, its
    ``requested`` flag) reached any of them (a max all-gather over processes, so all of them stop after the same
    step); a collective: every process must call it at the same point.
    Raises what the JAX all-gather raises when the processes are out of step. Source: SLURM / TPU preemption sends
    SIGTERM. Returns a Python bool."""
    return allgather_max(float(preempt.requested)) > 0


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
