"""``trainer.precompile``: a bounded set of update programs, all compiled during the warm-up.

With it on (``auto``: on for GPU / TPU, off on CPU), a packed update (``model.use_remove_padding``) no longer
picks the tightest geometry and micro-batch count of each rollout batch (a new compiled program for almost
every batch): it keeps the configured micro-batch count K and the first of at most three fixed geometries
(``stapo_jax.train.packing.fixed_geometries``: a quarter, a half, all of a padded micro-batch's tokens) that
holds the batch. In RL step 1, before its update, every one of those geometries is compiled for the
old-log-prob pass and the update steps (``update_policy(compile_only=True)`` on the step's own experience with
empty masks, so shapes, dtypes and shardings are exactly those of the later calls), under a progress bar.

Programs per phase after the warm-up (documented bound, checked by tests/runtime/test_compile_accounting.py):
update: at most 3 ``step`` (x2 with ``s2t.minibatch_method=prepass``) and 3 old-log-prob ``fn``; rollout
(in-process sampler, compiled before the held-out pass by :func:`precompile_sampler`): with P prefill buckets,
K KV-cache lengths (``rollout.kv_cache_buckets: false``: K = 1) and S sampling settings (RL, + greedy with a
held-out split), at most P prefills + K x S decode steps + K x P inserts + K x (K - 1) resizes
(``stapo_jax.rollout.warmup.rollout_programs``). Warm-up = everything up to the end of RL step 1; after it a run
compiles nothing (``summary.json``'s ``compile_after_warmup`` lists any exception).
"""
from __future__ import annotations

import dataclasses
from typing import Union

import jax
import numpy as np

from stapo_jax.rollout.sampling import SamplingParams
from stapo_jax.rollout.warmup import precompile_rollout
from stapo_jax.runtime.compile_stats import CompileStats
from stapo_jax.runtime.watchdog import progress as mark_progress
from stapo_jax.train.metrics import progress_bar
from stapo_jax.train.packing import fixed_geometries
from stapo_jax.train.update import update_policy


def precompile_enabled(setting: Union[bool, str]) -> bool:
    """``trainer.precompile`` resolved: True / False as given; ``auto`` = on when JAX's default backend is a GPU
    or TPU. Takes a bool or ``"auto"``; returns a bool. Raises ValueError for anything else (names the key).
    Source: issue 33 (compile up front where compiles are slow: accelerators)."""
    if isinstance(setting, bool):
        return setting
    if setting == "auto":
        return jax.default_backend() in ("gpu", "tpu", "cuda", "rocm")
    raise ValueError(f"trainer.precompile must be true, false or auto, got {setting!r}")


def update_geometries(mini_rows: int, num_micro_batches: int, num_shards: int, width: int,
                      long_rows: bool) -> list[tuple[int, int]]:
    """The fixed packed geometries of one micro-batch block (``mini_rows / num_shards / K`` sequences of
    ``width`` = P + R tokens): :func:`stapo_jax.train.packing.fixed_geometries`. Ints in, ``[(M, L)]`` int pairs
    out;
    raises ValueError for sizes that do not split. Source: issue 33's bounded shapes."""
    per, rem = divmod(mini_rows, num_shards * num_micro_batches)
    if rem or per < 1:
        raise ValueError(f"mini_rows={mini_rows} does not split into {num_shards} shards x {num_micro_batches} "
                         f"micro-batches")
    return fixed_geometries(per, width, long_rows)


def precompile_update(state, exp, step_fns, log_prob_fn, geometries: list[tuple[int, int]], *,
                      stats: CompileStats, progress: bool = True, **update_kw) -> None:
    """Compile the old-log-prob pass and the update steps at every geometry of ``geometries`` (charged to the
    ``precompile`` phase of ``stats``), from ``exp`` (an ``experience.Experience``) with its masks emptied, so
    every array has the shape, dtype and sharding of a real update. ``update_kw``: the keyword arguments of
    the real :func:`~stapo_jax.train.update.update_policy` call (mini_rows, ppo_epochs, mesh, ...).
    Runs nothing (``state`` is neither read nor donated). Raises what compilation raises. Source: JAX's
    ahead-of-time ``jit(f).lower(...).compile()``."""
    arrays = dict(exp.arrays)
    for key in ("attention_mask", "response_mask"):
        arrays[key] = np.zeros_like(arrays[key])
    empty = dataclasses.replace(exp, arrays=arrays)
    with stats.phase("precompile"), progress_bar(len(geometries), "precompile update", unit="program",
                                                 enabled=progress) as bar:
        for geometry in geometries:
            update_policy(state, empty, step_fns, log_prob_fn, geometries=[geometry], compile_only=True,
                          **update_kw)
            bar.update(1)
            mark_progress("precompile")  # each compiled program counts as progress for the stall watchdog


def precompile_sampler(rollout, *, greedy: bool, stats: CompileStats, progress: bool = True) -> None:
    """Compile every rollout program of the run (``stapo_jax.rollout.warmup.precompile_rollout``: prefill
    buckets, and per KV-cache length the decode step, inserts and resizes) for the RL sampling setting and,
    with ``greedy``, the held-out passes' greedy one; charged to the ``precompile`` phase of ``stats``, under a
    progress bar. ``rollout``: the in-process sampler (``build_rollout`` with ``rollout.mode=inprocess``); no
    arrays in or out (the engine's own dtypes and shapes).
    Raises what the engine raises. Source: JetStream's engine warm-up."""
    samplings = [None] + ([SamplingParams(greedy=True)] if greedy else [])
    with stats.phase("precompile"), progress_bar(len(rollout.engine.kv_length_buckets), "precompile rollout",
                                                 unit="KV length", enabled=progress) as bar:
        precompile_rollout(rollout, samplings, bar=bar)
