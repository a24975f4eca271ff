"""The policy update as one unit: built once from the recipe, the optimizer, the mesh and the actor's settings,
it owns the micro-batch count K, the jitted programs per K (first-mini-batch step, step, old-log-prob pass), their
precompile, the old / reference log-prob passes and the mini-batch loop, and exposes one call
``(state, experience) -> (state, metrics)``. The trainer's RL step and ``stapo-jax plan`` (which compiles the
programs of a run without running it) use the same object, so the planner compiles exactly the run's programs.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import jax

from stapo_jax.train.precompile import precompile_update, update_geometries
from stapo_jax.train.train_step import make_log_prob_fn, make_update_steps
from stapo_jax.train.update import balance_allowed, data_parallel_size, token_budget_micro_batches, update_policy

__all__ = ["PolicyUpdate"]


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

    Raises: nothing at construction; the call raises what ``update.update_policy`` raises (misshaped experience,
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
        where the micro-batch does not matter (``update.balance_allowed``): fewer, fuller micro-batches of
        variable sequence counts within one padded micro-batch's tokens. ``precompile``: compile every program of
        the run first (``bounded`` runs, their first update). ``stats``: a ``CompileStats`` whose ``precompile``
        / ``update`` phases are charged (None: not recorded). ref_params: the reference policy (KL term).
        Raises: what ``update.update_policy`` raises."""
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
