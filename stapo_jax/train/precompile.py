"""``trainer.precompile``: a bounded set of update programs, all compiled during the warm-up.

With it on (``auto``: on for GPU / TPU, off on CPU), a packed update (``model.use_remove_padding``) no longer
picks the tightest geometry and micro-batch count of each rollout batch (a new compiled program for almost
every batch): it keeps the configured micro-batch count K and the first of at most three fixed geometries
(``stapo_jax.train.packing.fixed_geometries``: a quarter, a half, all of a padded micro-batch's tokens) that
holds the batch. In RL step 1, before its update, every one of those geometries is compiled for the
old-log-prob pass and the update steps (``stapo_jax.train.policy_update.precompile_update``, run by
``PolicyUpdate``: the update's own loop with ``compile_only`` on the step's experience with empty masks, so
shapes, dtypes and shardings are exactly those of the later calls), under a progress bar. This module keeps the
setting and the rollout's side.

Programs per phase after the warm-up (documented bound, checked by tests/runtime/test_compile_accounting.py):
update: at most 3 ``step`` (x2 with ``s2t.minibatch_method=prepass``) and 3 old-log-prob ``fn``; rollout
(in-process sampler, compiled before the held-out pass by :func:`precompile_sampler`): with P prefill buckets,
K KV-cache lengths (``rollout.kv_cache_buckets: false``: K = 1) and S sampling settings (RL, + greedy with a
held-out split), at most P prefills + K x S decode steps + K x P inserts + K x (K - 1) resizes
(``stapo_jax.rollout.warmup.rollout_programs``). Warm-up = everything up to the end of RL step 1; after it a run
compiles nothing (``summary.json``'s ``compile_after_warmup`` lists any exception).
"""
from __future__ import annotations

from typing import Union

import jax

from stapo_jax.rollout.sampling import SamplingParams
from stapo_jax.rollout.warmup import precompile_rollout
from stapo_jax.runtime.compile_stats import CompileStats
from stapo_jax.train.metrics import progress_bar


def precompile_enabled(setting: Union[bool, str]) -> bool:
    """``trainer.precompile`` resolved: True / False as given; ``auto`` = on when JAX's default backend is a GPU
    or TPU. Takes a bool or ``"auto"``; returns a bool. Raises ValueError for anything else (names the key).
    Source: issue 33 (compile up front where compiles are slow: accelerators)."""
    if isinstance(setting, bool):
        return setting
    if setting == "auto":
        return jax.default_backend() in ("gpu", "tpu", "cuda", "rocm")
    raise ValueError(f"trainer.precompile must be true, false or auto, got {setting!r}")


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
