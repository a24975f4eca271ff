"""The policy update as one unit (verl ``DataParallelPPOActor.update_policy``): :class:`PolicyUpdate` is built
once from the recipe, the optimizer, the mesh and the actor's settings; it owns the micro-batch count K, the
jitted programs per K (first-mini-batch step, step, old-log-prob pass), their precompile, the old / reference
log-prob passes and the mini-batch loop (:func:`update_policy`), and exposes one call
``(state, experience) -> (state, metrics)``. The trainer's RL step and ``stapo-jax plan`` (which compiles the
programs of a run without running it) use the same object, so the planner compiles exactly the run's programs.

The path from the trainer to the loss: ``rl_step.step_update`` -> :class:`PolicyUpdate` (this module) ->
``train_step.make_train_step``'s jitted step (micro-batch scan, mask strategy, the registered policy loss).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from stapo_jax.runtime.compile_stats import CompileStats
from stapo_jax.runtime.watchdog import progress as mark_progress
from stapo_jax.train.mask_strategy import count_metrics
from stapo_jax.train.metrics import progress_bar
from stapo_jax.train.micro_batches import (balance_allowed, data_parallel_size, token_budget_micro_batches,
                                           update_geometries)
from stapo_jax.train.packing import gather_slots, pack_micro_batches
from stapo_jax.train.train_step import Batch, TrainState, make_log_prob_fn, make_update_steps, place_rows

__all__ = ["PolicyUpdate", "update_policy", "precompile_update"]


class PolicyUpdate:
    """One RL policy update (verl ``update_actor``), ``update(state, exp) -> (state, metrics)``.

    Args:
      recipe: the ``stapo_jax.algo.recipes.Recipe``; optimizer: the optax transformation of the state.
      mesh: the training mesh (None: one device). temperature: the sampler's (log-probs are of ``logits / T``).
      seq_chunk / vocab_chunk: the log-prob chunking (``actor.logprob_seq_chunk`` / ``logprob_vocab_chunk``).
      vocab_size: |V| (the diagnostics' bounds). state_shardings: the ``TrainState``'s shardings pytree.
      mini_rows: global rows per mini-batch (``ppo_mini_batch_size x rollout.n``). num_micro_batches: K
        (``config.schema.micro_batch_count``). ppo_epochs: passes over the batch. packed: padding-free rows
        (``model.use_remove_padding``). long_rows: a packed micro-batch is one long row. bounded: fixed update
        shapes, every program compiled before the first update (``trainer.precompile``). sequences_cap: most
        sequences per packed micro-batch (``actor.sequences_cap()``). donate: the update writes into its input
        state's buffers (the caller never reads a donated state again).

    Raises: nothing at construction; the call raises what :func:`update_policy` raises (misshaped experience,
    rows that do not split into shards and micro-batches). Source: verl ``DataParallelPPOActor.update_policy``.
    """

    def __init__(self, recipe, optimizer, mesh, *, temperature: float, seq_chunk: Optional[int],
                 vocab_chunk: Optional[int], vocab_size: int, state_shardings: Any, mini_rows: int,
                 num_micro_batches: int, ppo_epochs: int = 1, packed: bool = False, long_rows: bool = True,
                 bounded: bool = False, sequences_cap: Optional[int] = None, donate: bool = True):
        self.recipe, self.optimizer, self.mesh = recipe, optimizer, mesh
        self.common = dict(temperature=temperature, seq_chunk=seq_chunk or 512, vocab_chunk=vocab_chunk)
        self.step_kw = dict(vocab_size=vocab_size, mesh=mesh, state_shardings=state_shardings, donate=donate,
                            **self.common)
        self.mini_rows, self.num_micro_batches, self.ppo_epochs = mini_rows, num_micro_batches, ppo_epochs
        self.packed, self.long_rows, self.bounded, self.sequences_cap = packed, long_rows, bounded, sequences_cap
        self.by_k: dict[int, tuple] = {}
        self.last_micro_batches = num_micro_batches  # K of the latest call (packed updates may use fewer)

    def programs(self, k: int) -> tuple:
        """``(first step, step, old-log-prob fn)`` for ``k`` micro-batches, jitted, built at the first call for
        ``k`` (``train_step.make_update_steps``: the first differs only where the mask's update entry gives a
        first-mini-batch recipe). Never raises here (tracing raises at the first call)."""
        if k not in self.by_k:
            self.by_k[k] = (*make_update_steps(self.recipe, self.optimizer, num_micro_batches=k, **self.step_kw),
                            jax.jit(make_log_prob_fn(num_micro_batches=k, **self.common), static_argnums=(1, 4)))
        return self.by_k[k]

    def __call__(self, state, exp, *, ref_params=None, precompile: bool = False, stats=None,
                 progress: bool = True) -> tuple[Any, dict]:
        """Update ``state`` on the experience ``exp`` (``experience.Experience``: ``[N, P + R]`` / ``[N, R]``
        arrays, N a multiple of ``mini_rows``); returns ``(new state, metrics)`` (float per key). Packed rows
        where the micro-batch does not matter (``micro_batches.balance_allowed``): fewer, fuller micro-batches of
        variable sequence counts within one padded micro-batch's tokens. ``precompile``: compile every program of
        the run first (``bounded`` runs, their first update). ``stats``: a ``CompileStats`` whose ``precompile``
        / ``update`` phases are charged (None: not recorded). ref_params: the reference policy (KL term).
        Raises: what :func:`update_policy` raises."""
        kk, slots, dp = self.num_micro_batches, None, data_parallel_size(self.mesh)
        if self.packed and balance_allowed(self.recipe) and not self.bounded:
            kk, slots = token_budget_micro_batches(exp.arrays["attention_mask"], mini_rows=self.mini_rows,
                                                   num_micro_batches=kk, num_shards=dp, long_rows=self.long_rows,
                                                   max_sequences=self.sequences_cap)
        first_fn, step_fn, log_prob_fn = self.programs(kk)
        update_kw = dict(mini_rows=self.mini_rows, ppo_epochs=self.ppo_epochs, mesh=self.mesh, num_micro_batches=kk,
                         use_remove_padding=self.packed, long_rows=self.long_rows, ref_params=ref_params)
        geometries = update_geometries(self.mini_rows, kk, dp, exp.arrays["input_ids"].shape[1], self.long_rows) \
            if self.bounded and self.packed else None
        if precompile:  # every update program of the run, before the first update runs
            precompile_update(state, exp, (first_fn, step_fn), log_prob_fn, geometries or [None], stats=stats,
                              progress=progress, **update_kw)
        self.last_micro_batches = kk
        with stats.phase("update") if stats is not None else contextlib.nullcontext():
            return update_policy(state, exp, (first_fn, step_fn), log_prob_fn, slots=slots, geometries=geometries,
                                 **update_kw)


def update_policy(state: TrainState, exp, step_fns, log_prob_fn, *, mini_rows: int, ppo_epochs: int = 1,
                  mesh=None, num_micro_batches: int = 1, use_remove_padding: bool = False, long_rows: bool = True,
                  slots=None, geometries=None, compile_only: bool = False, ref_params=None):
    """Old log-probs over the whole rollout batch (trainer forward, θ_old), then one optimizer step per
    mini-batch of ``mini_rows`` sequences. ``step_fns = (first, rest)``: with ``s2t.minibatch_method=prepass``
    the first mini-batch uses a step that takes its token statistics from the old-log-prob pass (θ = θ_old
    there, stapo_spec §3), saving the pre-pass; with ``correction`` both are the same step (``old_entropy``
    gives it the provisional tau_h, exact on the first mini-batch).

    Args:
      exp: an ``experience.Experience`` whose ``arrays`` hold ``input_ids`` int32 / ``attention_mask`` bool [B, P+R],
        ``response_mask`` bool [B, R], ``advantages`` float32 [B] or [B, R] (and optionally ``rollout_log_probs``
        float32 [B, R]); the same global rows on every process. ``mini_rows`` must divide into the mesh's
        data-parallel shards (``batch_shapes.check_batch_shapes`` checks that first).
      mesh: the training mesh (rows go to its data-parallel devices); None = one device.
      num_micro_batches: K of ``step_fns`` / ``log_prob_fn`` (the packed layout is planned per micro-batch).
      use_remove_padding: pack each micro-batch (``stapo_jax.train.packing.pack_micro_batches``, each
        data-parallel shard its own rows), planned on the host once per mini-batch and given to the old-log-prob
        pass and every epoch's update through ``Batch.packing`` (verl's ``model.use_remove_padding``).
      long_rows: packed rows may be longer than ``P + R`` (one row per micro-batch and shard; only for an
        attention whose cost follows the segments, ``stapo_jax.train.packing.packing_long_rows``).
      slots: with ``use_remove_padding``, the slot layout of :func:`token_budget_micro_batches` (for this
        ``num_micro_batches``): every mini-batch becomes ``len(slots) / (B / mini_rows)`` rows, micro-batch ``j``
        holding a variable number of sequences and dummy slots with all-zero masks (``packing.gather_slots``),
        which add nothing to any loss, denominator (seq-mean modes count only non-empty rows), threshold
        population or metric. Only where :func:`balance_allowed`.
      geometries: with ``use_remove_padding``, the bounded set of packed ``(M, L)`` of ``trainer.precompile``
        (``packing.fixed_geometries``; None: the tightest geometry of each mini-batch).
      ref_params: the reference policy's parameters (``actor.use_kl_loss``; the policy at the start of RL, same
        tree and shardings as ``state.params``): the same log-prob program gives ``ref_log_probs`` [B, R] float32
        for every mini-batch's ``Batch`` (verl's ``compute_ref_log_prob``, at the rollout temperature); None:
        no KL term's inputs.
      compile_only: compile (``jit(...).lower(...).compile()``) the old-log-prob pass and every step this update
        would run, at exactly the shapes, dtypes and shardings of its arrays, without running them; returns
        ``(state, {})`` with ``state`` untouched (the compiled programs serve the later calls).
      step_fns may donate the state (``make_train_step(donate=True)``, as the trainer builds them): ``state``'s
      buffers are then consumed and only the returned state is valid. The mini-batch steps are dispatched
      back to back; their metrics come to the host once, after the last one.
    Returns:
      (state, metrics: float per key, averaged over mini-batches; ``mask_strategy.count_metrics()`` summed; plus
      ``sampler_trainer/logp_diff_mean|max`` when the sampler's log-probs are present, conventions.md §5).
    Raises: ValueError when the rows do not split into the mesh's data shards (JAX) or into ``slots``, and from
    the step for misshaped arrays."""
    a, num_rows, mini_rows = _arrange_rows(exp.arrays, exp.num_rows, mini_rows, use_remove_padding, slots)
    # every process holds the same global experience (multi-controller): mini-batch k is the global row slice
    # [k*M, (k+1)*M), each device receives its rows of it; the old log-probs come back with an all-gather
    put = lambda x: place_rows(x, mesh)  # noqa: E731
    packing = dict(num_micro_batches=num_micro_batches, num_shards=data_parallel_size(mesh), long_rows=long_rows,
                   geometries=geometries) if use_remove_padding else None
    old_lp, old_ent, ref_lp, layouts = _old_log_probs(state, a, log_prob_fn, num_rows, mini_rows, mesh, put,
                                                      packing, compile_only, ref_params)
    metrics: list[dict] = []
    compiled: list = []
    rollout_lp = a.get("rollout_log_probs")
    for epoch in range(ppo_epochs):  # verl: ppo_epochs passes, mini-batches in order (shuffle false)
        for s in range(0, num_rows, mini_rows):
            sl = slice(s, s + mini_rows)
            batch = Batch(input_ids=put(a["input_ids"][sl]), attention_mask=put(a["attention_mask"][sl]),
                          response_mask=put(a["response_mask"][sl]), advantages=put(a["advantages"][sl]),
                          old_log_probs=put(old_lp[sl]), old_entropy=put(old_ent[sl]),
                          rollout_log_probs=None if rollout_lp is None else put(rollout_lp[sl]),
                          ref_log_probs=None if ref_lp is None else put(ref_lp[sl]),
                          packing=layouts.get(s))
            fn = step_fns[0 if (epoch == 0 and s == 0) else 1]
            if compile_only:
                if fn not in compiled:
                    compiled.append(fn)
                    fn.lower(state, batch).compile()
                continue
            state, m = fn(state, batch)
            metrics.append(m)  # device scalars: no host round trip between mini-batches
    if compile_only:
        return state, {}
    return state, _update_metrics(jax.device_get(metrics), a, old_lp)


def _arrange_rows(a: dict, num_rows: int, mini_rows: int, use_remove_padding: bool, slots) -> tuple[dict, int, int]:
    """``(arrays, num_rows, mini_rows)`` in the row order the packed update uses: gathered into ``slots`` (rows
    per mini-batch change), or as they are."""
    if use_remove_padding and slots is not None:
        if len(slots) % (num_rows // mini_rows):
            raise ValueError(f"update_policy: {len(slots)} slots for {num_rows // mini_rows} mini-batches")
        a = {key: gather_slots(v, slots) if getattr(v, "shape", ())[:1] == (num_rows,) else v for key, v in a.items()}
        return a, len(slots), len(slots) // (num_rows // mini_rows)
    return a, num_rows, mini_rows


def _old_log_probs(state: TrainState, a: dict, log_prob_fn, num_rows: int, mini_rows: int, mesh, put,
                   packing: Optional[dict], compile_only: bool, ref_params=None):
    """``(old_log_probs, old_entropy, ref_log_probs, layouts)``: the θ_old pass per mini-batch, gathered to
    ``[B, R]`` float32 on the host (zeros with ``compile_only``, which compiles the pass once), the same pass
    with ``ref_params`` (None without them; the same compiled program), and each mini-batch's packed layout
    (``packing``: ``pack_micro_batches``' keyword arguments, None = padded rows) by its first row."""
    R = a["response_mask"].shape[1]
    get = (lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))) if mesh is not None \
        else np.asarray
    old_lp, old_ent, ref_lp, layouts = [], [], [], {}
    for s in range(0, num_rows, mini_rows):
        if packing is not None:
            lay = pack_micro_batches(a["input_ids"][s:s + mini_rows], a["attention_mask"][s:s + mini_rows], R,
                                     **packing)
            layouts[s] = jax.tree.map(put, lay)
        args = (state.params, state.graphdef, put(a["input_ids"][s:s + mini_rows]),
                put(a["attention_mask"][s:s + mini_rows]), R, layouts.get(s))
        if compile_only:
            if s == 0:
                log_prob_fn.lower(*args).compile()
            for out in (old_lp, old_ent, ref_lp):
                out.append(np.zeros((mini_rows, R), np.float32))
            continue
        lp, ent = log_prob_fn(*args)
        old_lp.append(get(lp))
        old_ent.append(get(ent))
        if ref_params is not None:
            ref_lp.append(get(log_prob_fn(ref_params, *args[1:])[0]))
    ref = np.concatenate(ref_lp) if ref_params is not None else None
    return np.concatenate(old_lp), np.concatenate(old_ent), ref, layouts


def _update_metrics(metrics: list[dict], a: dict, old_lp: np.ndarray) -> dict[str, float]:
    """The mini-batches' metrics averaged (``mask_strategy.count_metrics()`` summed), plus the sampler-trainer log-prob gap."""
    counts = count_metrics()
    out = {k: float((np.sum if k in counts else np.mean)([m[k] for m in metrics])) for k in metrics[0]}
    if "rollout_log_probs" in a:  # sampler vs trainer log-prob gap on valid tokens (conventions.md §5)
        mask = a["response_mask"]
        gap = np.abs(old_lp - a["rollout_log_probs"])[mask]
        out["sampler_trainer/logp_diff_mean"] = float(gap.mean()) if gap.size else 0.0
        out["sampler_trainer/logp_diff_max"] = float(gap.max()) if gap.size else 0.0
    return out


def precompile_update(state, exp, step_fns, log_prob_fn, geometries: list[tuple[int, int]], *,
                      stats: Optional[CompileStats], progress: bool = True, **update_kw) -> None:
    """Compile the old-log-prob pass and the update steps at every geometry of ``geometries`` (charged to the
    ``precompile`` phase of ``stats``; None: not recorded), from ``exp`` (an ``experience.Experience``) with its masks emptied, so
    every array has the shape, dtype and sharding of a real update. ``update_kw``: the keyword arguments of
    the real :func:`update_policy` call (mini_rows, ppo_epochs, mesh, ...).
    Runs nothing (``state`` is neither read nor donated). Raises what compilation raises. Source: JAX's
    ahead-of-time ``jit(f).lower(...).compile()``."""
    arrays = dict(exp.arrays)
    for key in ("attention_mask", "response_mask"):
        arrays[key] = np.zeros_like(arrays[key])
    empty = dataclasses.replace(exp, arrays=arrays)
    phase = stats.phase("precompile") if stats is not None else contextlib.nullcontext()
    with phase, progress_bar(len(geometries), "precompile update", unit="program", enabled=progress) as bar:
        for geometry in geometries:
            update_policy(state, empty, step_fns, log_prob_fn, geometries=[geometry], compile_only=True,
                          **update_kw)
            bar.update(1)
            mark_progress("precompile")  # each compiled program counts as progress for the stall watchdog
