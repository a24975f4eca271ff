"""STAPO's S2T threshold in one place: where the mini-batch statistics come from, the provisional threshold,
the exact threshold and the correction pass, and the two update steps a training step needs.

The S2T entropy threshold ``tau_h`` is a quantile over the whole mini-batch *under the current policy*
(stapo_spec.md §3). The update gets it one of three ways (:func:`minibatch_stats_mode`):

* ``correction`` (default, ``s2t.minibatch_method=correction`` with ``old_entropy`` in the batch): mask with a
  *provisional* ``tau_h`` = the quantile of the old policy's entropies (:func:`provisional_tau_h`; exact on the
  first mini-batch of a step, where θ = θ_old) during the gradient pass, take the *exact* ``tau_h`` from the
  entropies that pass returns, and redo forward + backward only for micro-batches whose mask changed
  (:func:`correction_pass`). The result equals the pre-pass update.
* ``prepass``: one forward-only pass over the mini-batch first. On the first mini-batch of a step the old
  policy's statistics are the current ones, so ``stapo_jax.train.train_step.make_update_steps`` gives a
  first-mini-batch step that reads ``old_log_probs`` / ``old_entropy`` instead (``stats_policy=old``), saving that
  pass.
* ``old`` (``s2t.stats_policy=old``): the old policy's statistics throughout.

These are pure functions of the recipe and the arrays; the train step (``stapo_jax.train.train_step``) uses them
through S2T's mask strategy, defined and registered with the others in ``stapo_jax.train.mask_strategy``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stapo_jax.algo.masks import S2T_TAU_H
from stapo_jax.algo.recipes import Recipe, compute_token_mask

__all__ = ["minibatch_stats_mode", "provisional_tau_h", "correction_pass"]


def minibatch_stats_mode(recipe: Recipe, has_old_entropy: bool) -> str:
    """Where the update takes the mini-batch statistics of the recipe's token mask from (the one place this is
    decided; ``make_train_step``, the trainer and ``stapo-jax plan`` all ask it).

    Returns ``"none"`` (no population mask, or ``microbatch`` scope: each micro-batch is its own population),
    ``"old"`` (S2T ``stats_policy=old``: the batch's ``old_log_probs`` / ``old_entropy``), ``"correction"`` (S2T
    ``minibatch_method=correction`` with ``old_entropy`` given) or ``"prepass"`` (a forward-only pass first).

    Takes ``has_old_entropy``: bool, whether the batch carries ``old_entropy`` [B, R]; returns a str.
    Never raises (the recipe's fields are validated when the :class:`Recipe` is built).
    Source: stapo_spec.md §3 (the S2T threshold is a quantile over the mini-batch under the current policy).
    """
    mask = recipe.token_mask
    if mask == "s2t" and recipe.s2t.stats_policy == "old":
        return "old"
    if recipe.mask_scope != "minibatch":
        return "none"
    if mask == "s2t" and recipe.s2t.minibatch_method == "correction" and has_old_entropy:
        return "correction"
    return "prepass"


def provisional_tau_h(recipe: Recipe, old_log_probs, old_entropy, advantages, response_mask) -> jax.Array:
    """The provisional S2T ``tau_h`` of ``minibatch_method=correction``: the recipe's quantile over the mini-batch
    under the *old* policy (``old_log_probs`` / ``old_entropy`` ``[B, R]`` float32, advantages ``[B]`` or
    ``[B, R]``, response_mask ``[B, R]`` float). Exact on the first mini-batch of a step. Returns a float32 scalar
    (NaN for an empty population). Raises: ValueError as :func:`stapo_jax.algo.recipes.compute_token_mask`
    (a mismatched shape or an invalid recipe setting). Source: stapo_spec.md §3."""
    return compute_token_mask(recipe, log_probs=old_log_probs, entropy=old_entropy, advantages=advantages,
                              response_mask=response_mask)[1][S2T_TAU_H]


def correction_pass(forward, surrogate, params, grad_sum, mbs, keep_guess, keep_exact, grad=None):
    """S2T ``minibatch_method='correction'``: add ``grad(sum_exact - sum_provisional)`` for every micro-batch in
    which the exact mini-batch ``tau_h`` changed the mask of at least one token (``lax.cond``: the others cost
    nothing), so the update equals the pre-pass update.

    Args: forward ``(params, micro_batch) -> (log_probs, entropy)``; surrogate ``(log_probs, entropy,
      micro_batch, keep) -> (loss_sum, ...)``; params; grad_sum (the gradient-sum pytree so far); mbs: the
      micro-batches stacked ``[K, ...]``; keep_guess / keep_exact: ``[K, B/K, R]`` bool; grad: ``grad(fn, params)
      -> (grads, aux)`` for ``fn -> (scalar, aux)`` (default ``jax.grad(fn, has_aux=True)``; the train step passes
      its own).
    Returns ``(grad_sum, metrics)`` with the counts ``s2t/correction_passes`` (micro-batches redone) and
    ``s2t/corrected_tokens`` (float32 scalars). Raises: whatever ``forward`` / ``surrogate`` raise at trace time
    (e.g. TypeError on mismatched pytrees); the function itself never raises. Source: stapo_spec.md §3 (exact
    mini-batch quantile)."""
    grad_fn = grad if grad is not None else (lambda fn, p: jax.grad(fn, has_aux=True)(p))
    changed = keep_guess != keep_exact
    redo = jnp.any(changed.reshape(changed.shape[0], -1), axis=1)

    def one(acc, xs):
        mb, kg, kc, flag = xs

        def fix(_):
            def diff(p):
                lp, ent = forward(p, mb)
                return surrogate(lp, ent, mb, kc)[0] - surrogate(lp, ent, mb, kg)[0], None

            return grad_fn(diff, params)[0]

        g = jax.lax.cond(flag, fix, lambda _: jax.tree.map(jnp.zeros_like, params), None)
        return jax.tree.map(jnp.add, acc, g), None

    grad_sum = jax.lax.cond(jnp.any(redo), lambda g: jax.lax.scan(one, g, (mbs, keep_guess, keep_exact, redo))[0],
                            lambda g: g, grad_sum)
    return grad_sum, {"s2t/correction_passes": jnp.sum(redo).astype(jnp.float32),
                      "s2t/corrected_tokens": jnp.sum(changed).astype(jnp.float32)}
