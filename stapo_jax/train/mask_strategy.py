"""How the train step gets the token mask of each micro-batch: a small strategy interface, so that
``stapo_jax.train.train_step.make_train_step`` accumulates gradients without naming any mask.

A :class:`MaskStrategy` is three functions the step calls in order (shapes: ``B`` rows, ``R`` response
positions, ``K`` micro-batches of ``B/K`` strided rows each, see :func:`split_micro_batches`):

1. ``prepare(ctx, params, batch) -> (state, per_micro)``: before the gradient pass. ``state`` is any pytree
   the later calls read (e.g. a threshold); ``per_micro`` a pytree with a leading ``K`` axis (or None) that
   the step scans over next to the micro-batches (e.g. a mask computed once on the whole mini-batch).
2. ``micro_mask(ctx, state, per_micro_j, log_probs, entropy, mb, j) -> (keep, tau_h)``: inside the gradient
   pass, for micro-batch ``j`` (stop-gradient ``log_probs`` / ``entropy`` ``[B/K, R]`` float32 of the current
   policy): the ``[B/K, R]`` bool keep mask (or selection, or None for no mask) and a float32 scalar entropy
   threshold for the diagnostics.
3. ``finish(x: FinishInputs) -> MaskOutcome``: after it, with every token's ``[B, R]`` statistics, the stacked
   ``[K, B/K, R]`` keeps and ``[K]`` taus (one typed bundle, :class:`FinishInputs`): the final gradient sum (a
   strategy may add a correction), the final ``[B, R]`` mask, the thresholds and any extra metrics.

What differs per mask is data: the mask's registry entry (``stapo_jax.algo.masks.TokenMask``: its threshold's
metric name, whether its threshold is the diagnostics' entropy threshold, whether rows may be reordered) and its
update entry here (:class:`MaskUpdateSpec`: its strategy, the recipe of a first mini-batch that may read the old
policy's statistics, its count metrics); no generic function names a mask.

This module holds the interface, the strategy lookup (:func:`mask_strategy`) and the two generic strategies
every registered mask (``stapo_jax.algo.masks.TOKEN_MASKS``) can use: :func:`per_micro_batch_strategy` (each
micro-batch is its own population: ``microbatch`` scope, or no mask) and :func:`full_batch_strategy` (the mask
computed once on the whole mini-batch from a forward-only pre-pass: ``minibatch`` scope). A mask may register
its own strategies (:func:`register_mask_strategy`); S2T's (old-policy statistics and the correction pass, from
the pure pieces of ``stapo_jax.algo.s2t``) are defined and registered at the end of this module.
Source: stapo_spec.md §3 (population of the threshold), conventions.md §2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from stapo_jax.algo.diagnostics import token_diagnostics
from stapo_jax.algo.masks import S2T_TAU_H, get_token_mask, masked_quantile
from stapo_jax.algo.recipes import Recipe, compute_token_mask, mask_selects_tokens
from stapo_jax.algo.s2t import correction_pass, minibatch_stats_mode, provisional_tau_h
from stapo_jax.core.registry import Registry

__all__ = ["count_metrics", "DIAGNOSTIC_COUNT_METRICS", "TAU_H_METRIC", "DiagnosticThresholds", "UpdateContext",
           "MaskStrategy", "MaskOutcome", "FinishInputs", "MaskUpdateSpec", "MASK_STRATEGIES", "first_minibatch_recipe",
           "register_mask_strategy", "mask_strategy", "mask_metrics",
           "diagnostic_tau_h", "per_micro_batch_strategy", "full_batch_strategy", "prepass_stats",
           "split_micro_batches", "join_micro_batches", "s2t_strategy", "s2t_first_minibatch", "old_policy_stats",
           "correction_strategy"]

# the token diagnostics' counts: reported as totals (sum of the weightless sums) over the micro-batches and the
# mini-batches of a step, not as means; count_metrics() (end of module) adds the registered strategies' own counts
DIAGNOSTIC_COUNT_METRICS = ("s2t/n_keep", "grad/bounds_violated")
# the token diagnostics' entropy threshold, reported for every recipe (stapo_spec.md §7)
TAU_H_METRIC = S2T_TAU_H


def split_micro_batches(x: Optional[jax.Array], k: int) -> Optional[jax.Array]:
    """``[B, ...] -> [K, B/K, ...]`` with micro-batch ``j`` = rows ``j, j+K, j+2K, ...`` (strided, so a batch
    sharded over rows stays shard-local). None passes through. Raises nothing: the caller checks ``K | B``.
    Source: verl's micro-batch split, strided here for sharded rows (conventions.md §2).
    Any dtype (the dtype is kept)."""
    if x is None:
        return None
    return x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)


def join_micro_batches(x: jax.Array) -> jax.Array:
    """Inverse of :func:`split_micro_batches`: ``[K, B/K, ...] -> [B, ...]`` in the original row order.
    Any dtype. Never raises. Source: conventions.md §2 (strided micro-batches)."""
    return x.swapaxes(0, 1).reshape((-1,) + x.shape[2:])


@dataclass(frozen=True)
class UpdateContext:
    """What the train step gives a strategy (built once per traced call).

    recipe: the :class:`~stapo_jax.algo.recipes.Recipe`. key: this update's PRNG key (random masks).
    num_micro_batches: ``K``. forward: ``(params, mb) -> (log_probs, entropy)`` ``[B/K, R]`` float32 of one
    micro-batch (differentiable). surrogate: ``(log_probs, entropy, mb, keep) -> (loss_sum, denominator,
    metrics)`` of ``compute_policy_loss``. grad: ``grad(fn, params) -> (grads, aux)`` for ``fn(params) ->
    (scalar, aux)``, the step's one gradient call. log_probs: ``(params, batch) -> (log_probs, entropy)``
    ``[B, R]`` float32, forward-only over the whole mini-batch (the pre-pass).
    """

    recipe: Recipe
    key: jax.Array
    num_micro_batches: int
    forward: Callable
    surrogate: Callable
    grad: Callable
    log_probs: Callable


class MaskOutcome(NamedTuple):
    """What :attr:`MaskStrategy.finish` returns. grad_sum: the gradient-sum pytree (like params). keep: ``[B, R]``
    bool or None, the final mask (a selection for a selecting mask). tau_rows: a float32 scalar or ``[B, 1]``,
    the threshold of each row for the token diagnostics. tau_h: float32 scalar, the ``s2t/tau_h`` metric (NaN
    allowed; the step reports it as 0). diag_stats: ``(log_probs, entropy)`` ``[B, R]`` that defined the mask.
    metrics: extra float32 scalar metrics."""

    grad_sum: Any
    keep: Optional[jax.Array]
    tau_rows: jax.Array
    tau_h: jax.Array
    diag_stats: tuple
    metrics: dict


class FinishInputs(NamedTuple):
    """What :attr:`MaskStrategy.finish` reads after the gradient pass. ctx: the :class:`UpdateContext`. state: what
    ``prepare`` returned. params: the parameter pytree. grad_sum: the gradient-sum pytree so far. log_probs /
    entropy: ``[B, R]`` float32 stop-gradient statistics of every token from the gradient pass. keeps: ``[K, B/K,
    R]`` bool (or None: no mask). taus: ``[K]`` float32 thresholds of the micro-batches. micro_batches: the
    ``Batch`` split ``[K, B/K, ...]``. batch: the mini-batch ``[B, ...]``."""

    ctx: UpdateContext
    state: Any
    params: Any
    grad_sum: Any
    log_probs: jax.Array
    entropy: jax.Array
    keeps: Optional[jax.Array]
    taus: jax.Array
    micro_batches: Any
    batch: Any


@dataclass(frozen=True)
class MaskStrategy:
    """The three calls of the train step's mask handling (see the module docstring for their signatures):
    ``prepare(ctx, params, batch)``, ``micro_mask(ctx, state, per_micro_j, log_probs, entropy, mb, j)``,
    ``finish(x: FinishInputs) -> MaskOutcome``."""

    prepare: Callable
    micro_mask: Callable
    finish: Callable


@dataclass(frozen=True)
class MaskUpdateSpec:
    """A token mask's entry in :data:`MASK_STRATEGIES`: how the update handles it.

    name: the mask (``actor.token_mask``). make: ``(recipe, has_old_entropy) -> MaskStrategy | None`` (None: the
    generic strategy of :func:`mask_strategy`). first_minibatch: ``(recipe) -> Recipe | None``, the recipe of the
    first mini-batch of a training step when it may differ (θ = θ_old there: S2T's ``prepass`` reads the old
    policy's statistics, saving the pre-pass), or None. count_metrics: the strategy's metrics that are counts
    (summed over mini-batches, not averaged)."""

    name: str
    make: Callable
    first_minibatch: Optional[Callable] = None
    count_metrics: tuple[str, ...] = ()


# mask name -> :class:`MaskUpdateSpec`; every entry is defined and registered in this module (S2T's at its end)
MASK_STRATEGIES: Registry = Registry("mask strategy", "actor.token_mask", homes=("stapo_jax.train.mask_strategy",))


def register_mask_strategy(name: str, *, first_minibatch: Optional[Callable] = None,
                           count_metrics: tuple[str, ...] = ()) -> Callable:
    """Decorator registering a strategy factory ``(recipe, has_old_entropy) -> MaskStrategy | None`` for the
    token mask ``name`` as a :class:`MaskUpdateSpec` with ``first_minibatch`` / ``count_metrics`` (its fields).
    Returns the decorator (the factory unchanged). Raises: ValueError if ``name`` already has one.
    Source: verl ``register_policy_loss``."""
    return MASK_STRATEGIES.register(name, lambda make: MaskUpdateSpec(name, make, first_minibatch,
                                                                      tuple(count_metrics)))


def first_minibatch_recipe(recipe: Recipe) -> Optional[Recipe]:
    """The recipe of a training step's first mini-batch when its mask's update entry gives one that differs
    (:attr:`MaskUpdateSpec.first_minibatch`), else None (every mini-batch runs ``recipe``). Never raises.
    Source: stapo_spec.md §3 (θ = θ_old on the first mini-batch)."""
    spec = MASK_STRATEGIES.get(recipe.token_mask)
    return None if spec is None or spec.first_minibatch is None else spec.first_minibatch(recipe)


def mask_strategy(recipe: Recipe, has_old_entropy: bool) -> MaskStrategy:
    """The strategy of ``recipe.token_mask``: its registered factory's choice if any, else
    :func:`full_batch_strategy` (pre-pass) for a ``minibatch``-scoped mask, else :func:`per_micro_batch_strategy`.
    ``has_old_entropy``: whether the batch carries ``old_entropy``. Raises: ValueError for an unknown mask.
    The strategy's masks are ``[B, R]`` bool. Source: stapo_spec.md §3 (population of the
    threshold)."""
    spec = MASK_STRATEGIES.get(recipe.token_mask)
    strategy = spec.make(recipe, has_old_entropy) if spec is not None else None
    if strategy is not None:
        return strategy
    return full_batch_strategy(prepass_stats) if recipe.mask_scope == "minibatch" else per_micro_batch_strategy()


@dataclass(frozen=True)
class DiagnosticThresholds:
    """The thresholds of the token diagnostics, the same for every mask (STAPO's token categories, stapo_spec.md
    §7): tau_p (probability, in (0, 1)), entropy_quantile (in (0, 1)) and quantile_method, which give ``tau_h``
    when the mask has no entropy threshold of its own. STAPO sets them in the recipe's ``s2t`` section
    (:meth:`of`, the one place they are read)."""

    tau_p: float
    entropy_quantile: float
    quantile_method: str

    @classmethod
    def of(cls, recipe: Recipe) -> "DiagnosticThresholds":
        """The recipe's diagnostic thresholds (``s2t.tau_p``, ``s2t.entropy_quantile``, ``s2t.quantile_method``).
        Never raises (validated with the recipe)."""
        return cls(recipe.s2t.tau_p, recipe.s2t.entropy_quantile, recipe.s2t.quantile_method)


def mask_metrics(recipe: Recipe, out: "MaskOutcome", batch, vocab_size: Optional[int] = None) -> dict:
    """The token diagnostics of a mini-batch (``stapo_jax.algo.diagnostics.token_diagnostics``) from the
    statistics that defined its final mask ``out`` (:class:`MaskOutcome`), plus the ``s2t/tau_h`` threshold metric
    (:data:`TAU_H_METRIC`; reported as 0 for an empty population: no NaN in the logs), all as ``{name: (sum,
    weight)}`` float32 scalar pairs for ``finalize_metrics``. batch: the mini-batch (``[B, R]`` arrays);
    vocab_size: |V| for the Theorem 3.1 bounds (None: skipped). Raises: ValueError as ``token_diagnostics``.
    Source: stapo_spec.md §3, §7."""
    loss, keep = recipe.loss, None if mask_selects_tokens(recipe.token_mask) else out.keep
    m = token_diagnostics(*out.diag_stats, batch.advantages, batch.old_log_probs,
                          batch.response_mask.astype(jnp.float32), keep,
                          tau_p=DiagnosticThresholds.of(recipe).tau_p, tau_h=out.tau_rows,
                          clip_ratio_low=loss.clip_ratio_low, clip_ratio_high=loss.clip_ratio_high,
                          clip_ratio_c=loss.clip_ratio_c, vocab_size=vocab_size, log_ratio_clamp=loss.log_ratio_clamp)
    m[TAU_H_METRIC] = (jnp.nan_to_num(out.tau_h, nan=0.0), jnp.ones((), jnp.float32))
    return m


def diagnostic_tau_h(recipe: Recipe, stats: dict, entropy: jax.Array, valid: jax.Array) -> jax.Array:
    """The entropy threshold the diagnostics use: the mask's own threshold from ``stats`` when its registry entry
    says it is the entropy threshold (``TokenMask.entropy_threshold``: S2T's ``tau_h`` over its own population),
    else the :class:`DiagnosticThresholds` entropy quantile of ``entropy`` over ``valid`` (``[N, R]``). Float32
    scalar, NaN for an empty population. Source: stapo_spec.md §3.
    Raises: ValueError as ``masked_quantile`` (misshaped arrays)."""
    spec = None if recipe.token_mask == "none" else get_token_mask(recipe.token_mask)
    if spec is not None and spec.entropy_threshold:
        return stats[spec.metric_name]
    d = DiagnosticThresholds.of(recipe)
    return masked_quantile(entropy, valid, d.entropy_quantile, d.quantile_method)


def _micro_batch_mask(ctx: UpdateContext, lp, ent, mb, j, tau_h=None):
    """The recipe's mask on micro-batch ``j`` alone (its own population, or a given ``tau_h``)."""
    resp = mb.response_mask.astype(jnp.float32)
    keep, stats = compute_token_mask(ctx.recipe, log_probs=lp, entropy=ent, advantages=mb.advantages,
                                     response_mask=resp, old_log_probs=mb.old_log_probs,
                                     key=jax.random.fold_in(ctx.key, j), tau_h=tau_h)
    return keep, diagnostic_tau_h(ctx.recipe, stats, ent, resp)


def micro_batch_outcome(grad_sum, lp, ent, keeps, taus, metrics=None, keep=None, tau_h=None) -> MaskOutcome:
    """The outcome when each micro-batch was masked on its own: the mask joined from ``keeps`` (unless ``keep``
    ``[B, R]`` is given), per-row thresholds from ``taus`` ``[K]``, the ``s2t/tau_h`` metric their NaN-free mean
    (unless ``tau_h`` is given: then it is also every row's threshold).
    grad_sum: the gradient-sum pytree; lp / ent: ``[B, R]`` float32; keeps: ``[K, B/K, R]`` bool or None. Never
    raises. Source: stapo_spec.md §10 item 12 (per-micro-batch populations)."""
    if keep is None and keeps is not None:
        keep = join_micro_batches(keeps)
    if tau_h is None:
        k, b = taus.shape[0], lp.shape[0]
        tau_rows = join_micro_batches(jnp.broadcast_to(taus[:, None], (k, b // k)))[:, None]
        tau_h = jnp.mean(jnp.nan_to_num(taus))
    else:
        tau_rows = tau_h
    return MaskOutcome(grad_sum, keep, tau_rows, tau_h, (lp, ent), metrics or {})


def per_micro_batch_strategy() -> MaskStrategy:
    """Each micro-batch is its own population (``microbatch`` scope, the 80/20 code's; or no mask): the mask is
    computed inside the gradient pass from that pass's statistics. Source: stapo_spec.md §10 item 12.
    Its masks are ``[B/K, R]`` bool per micro-batch, thresholds float32 scalars. Raises: ValueError as
    ``compute_token_mask`` when run."""

    def finish(x: FinishInputs) -> MaskOutcome:
        return micro_batch_outcome(x.grad_sum, x.log_probs, x.entropy, x.keeps, x.taus)

    return MaskStrategy(prepare=lambda ctx, params, batch: (None, None),
                        micro_mask=lambda ctx, state, pm, lp, ent, mb, j: _micro_batch_mask(ctx, lp, ent, mb, j),
                        finish=finish)


def prepass_stats(ctx: UpdateContext, params, batch):
    """``(log_probs, entropy)`` ``[B, R]`` float32 of the whole mini-batch under the current (stop-gradient)
    parameters: the forward-only pre-pass. Source: stapo_spec.md §3.
    Raises what ``ctx.log_probs`` raises (misshaped batch arrays)."""
    return ctx.log_probs(jax.lax.stop_gradient(params), batch)


def full_batch_strategy(stats_fn: Callable) -> MaskStrategy:
    """The mask computed once on the whole mini-batch (``minibatch`` scope: one population over all micro-batches
    and, under ``jit`` with batch-sharded inputs, all data-parallel shards) from the statistics
    ``stats_fn(ctx, params, batch) -> (log_probs, entropy)`` ``[B, R]`` (:func:`prepass_stats`, or the old
    policy's for S2T ``stats_policy=old``); the gradient pass reads its slice. Raises what ``stats_fn`` raises.
    Source: stapo_spec.md §3. Statistics float32, masks bool."""

    def prepare(ctx, params, batch):
        stats = stats_fn(ctx, params, batch)
        resp = batch.response_mask.astype(jnp.float32)
        keep, st = compute_token_mask(ctx.recipe, log_probs=stats[0], entropy=stats[1], advantages=batch.advantages,
                                      response_mask=resp, old_log_probs=batch.old_log_probs, key=ctx.key)
        tau = diagnostic_tau_h(ctx.recipe, st, stats[1], resp)
        return (stats, keep, tau), split_micro_batches(keep, ctx.num_micro_batches)

    def finish(x: FinishInputs) -> MaskOutcome:
        stats, keep, tau = x.state
        return MaskOutcome(x.grad_sum, keep, tau, tau, stats, {})

    return MaskStrategy(prepare=prepare, micro_mask=lambda ctx, state, pm, lp, ent, mb, j: (pm, state[2]),
                        finish=finish)


# ---------------------------------------------------------------- S2T's strategies (stapo_spec.md §3)


def old_policy_stats(ctx, params, batch):
    """``(old_log_probs, old_entropy)`` ``[B, R]`` float32 of the batch: the statistics of ``stats_policy=old``.
    Raises: ValueError when the batch has no ``old_entropy``. Source: stapo_spec.md §3 (``stats_policy=old``:
    the rollout policy's statistics, as verl's ``old_log_probs``)."""
    if batch.old_entropy is None:
        raise ValueError("s2t.stats_policy='old' needs batch.old_entropy")
    return batch.old_log_probs, batch.old_entropy


def correction_strategy() -> MaskStrategy:
    """``minibatch_method=correction``: the gradient pass masks each micro-batch with the provisional ``tau_h``
    (:func:`provisional_tau_h`); ``finish`` takes the exact mini-batch ``tau_h`` from that pass's entropies and adds
    :func:`correction_pass`. Metrics ``s2t/correction_passes``, ``s2t/corrected_tokens`` (float32 scalars);
    the masks it builds are ``[B, R]`` bool over ``[B, R]`` float32 log-probs / entropies. Raises: ValueError as
    :func:`stapo_jax.algo.recipes.compute_token_mask`. Source: stapo_spec.md §3."""

    def prepare(ctx, params, batch):
        resp = batch.response_mask.astype(jnp.float32)
        return provisional_tau_h(ctx.recipe, batch.old_log_probs, batch.old_entropy, batch.advantages, resp), None

    def micro_mask(ctx, tau_guess, pm, lp, ent, mb, j):
        keep, st = compute_token_mask(ctx.recipe, log_probs=lp, entropy=ent, advantages=mb.advantages,
                                      response_mask=mb.response_mask.astype(jnp.float32),
                                      old_log_probs=mb.old_log_probs, key=jax.random.fold_in(ctx.key, j),
                                      tau_h=tau_guess)
        return keep, st[S2T_TAU_H]

    def finish(x: FinishInputs) -> MaskOutcome:
        ctx, batch = x.ctx, x.batch
        keep, stats = compute_token_mask(ctx.recipe, log_probs=x.log_probs, entropy=x.entropy,
                                         advantages=batch.advantages,
                                         response_mask=batch.response_mask.astype(jnp.float32))
        grad_sum, extra = correction_pass(ctx.forward, ctx.surrogate, x.params, x.grad_sum, x.micro_batches, x.keeps,
                                          split_micro_batches(keep, ctx.num_micro_batches), grad=ctx.grad)
        return micro_batch_outcome(grad_sum, x.log_probs, x.entropy, x.keeps, x.taus, extra, keep=keep,
                                   tau_h=stats[S2T_TAU_H])

    return MaskStrategy(prepare=prepare, micro_mask=micro_mask, finish=finish)


def s2t_first_minibatch(recipe: Recipe) -> Optional[Recipe]:
    """S2T's first mini-batch of a step: with the ``prepass`` mode it reads the rollout policy's statistics
    (``stats_policy=old``; θ = θ_old there), saving the pre-pass; else None. Never raises.
    Source: stapo_spec.md §3."""
    if minibatch_stats_mode(recipe, has_old_entropy=True) == "prepass":
        return recipe.replace(s2t={"stats_policy": "old"})
    return None


@register_mask_strategy("s2t", first_minibatch=s2t_first_minibatch,
                        count_metrics=("s2t/correction_passes", "s2t/corrected_tokens"))
def s2t_strategy(recipe: Recipe, has_old_entropy: bool):
    """The S2T update strategy by :func:`minibatch_stats_mode`: ``old`` -> the mask once from the old policy's
    statistics, ``correction`` -> :func:`correction_strategy`; None (the generic pre-pass / per-micro-batch
    strategy of this module) otherwise.

    Takes ``has_old_entropy``: bool; returns a :class:`MaskStrategy` or None, whose masks are
    ``[B, R]`` bool. Never raises here; the strategies raise ValueError as
    :func:`stapo_jax.algo.recipes.compute_token_mask` when run. Source: stapo_spec.md §3."""
    mode = minibatch_stats_mode(recipe, has_old_entropy)
    return {"old": full_batch_strategy(old_policy_stats), "correction": correction_strategy()}.get(mode)


def count_metrics() -> tuple[str, ...]:
    """The metric names that are counts (summed over micro-batches and mini-batches, not averaged): the token
    diagnostics' (:data:`DIAGNOSTIC_COUNT_METRICS`) and every registered strategy's own
    (:attr:`MaskUpdateSpec.count_metrics`), read when called, so a strategy registered after import counts too.
    Returns a tuple of str. Never raises. Source: verl's ``reduce_metrics`` (means) with counts kept as totals."""
    return DIAGNOSTIC_COUNT_METRICS + tuple(m for spec in MASK_STRATEGIES.values() for m in spec.count_metrics)
