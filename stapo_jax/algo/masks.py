"""Token masks: which valid response tokens enter the policy-gradient loss.

Every mask is a function of stop-gradient inputs, registered by name (:data:`TOKEN_MASKS`, as verl's
``core_algos`` registers its policy losses) with the statistics it needs and its population, and returns
``(mask, threshold)``: a boolean array of the shape of ``response_mask`` that is False wherever
``response_mask`` is 0 (a *keep* mask, or for ``kl_cov`` a *selection*), and the scalar threshold of the
statistic that decided it (NaN when the population is empty; comparisons with NaN are False, so the mask then
selects nothing). The objective (``objectives.py``) multiplies ``keep`` into its numerator and, when
renormalising, its denominator.

Population of the thresholds (``tau_h`` of S2T, the top-k of 20-Entropy) = the tokens of the arrays passed
in, plus, when ``axis_name`` is given (inside ``jax.shard_map``), the same arrays of every shard along that
mesh axis (``jax.lax.all_gather``), so the threshold is exact and identical on all shards. Under plain
``jax.jit`` with sharded inputs the population is the whole global array automatically. Scopes map to calls:

* ``microbatch``: call on one micro-batch, no ``axis_name`` (per device; the 80/20 code's scope);
* ``minibatch`` (default): call once on the forward-only pre-pass statistics of the whole mini-batch, with the
  data axes as ``axis_name`` (stapo_spec.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from stapo_jax.algo.mask_settings import (  # noqa: F401  (re-exported: part of this module's API)
    QUANTILE_METHODS,
    QUANTILE_SCOPES,
    QUANTILE_TOKENS,
    CovConfig,
    S2TConfig,
    TopEntropyConfig,
)
from stapo_jax.core.registry import Registry
from stapo_jax.core.settings import check_one_of

__all__ = [
    "S2T_TAU_H",
    "TokenMask",
    "TOKEN_MASKS",
    "register_token_mask",
    "get_token_mask",
    "S2TConfig",
    "TopEntropyConfig",
    "CovConfig",
    "masked_quantile",
    "s2t_mask",
    "top_entropy_mask",
    "clip_cov_mask",
    "kl_cov_mask",
    "QUANTILE_METHODS",
    "QUANTILE_SCOPES",
    "QUANTILE_TOKENS",
]


@dataclass(frozen=True)
class TokenMask:
    """A registered token mask.

    name: the recipe's ``token_mask`` value. fn: ``fn(*needs, response_mask, **settings) -> (mask, threshold)``.
    needs: the statistics it reads, by their batch names (``log_probs``, ``entropy``, ``advantages``,
    ``old_log_probs``, ``key``). settings: dotted recipe fields passed as keyword arguments (the keyword is the
    last part), e.g. ``s2t.tau_p``. population: in words, the tokens its threshold is taken over. scope: the
    dotted recipe field naming its population scope (``microbatch`` / ``minibatch``), or None (each call is its own
    population). selects: the mask selects tokens for a penalty (``kl_cov_selection``) instead of keeping them.
    renormalize: whether dropped tokens leave the denominator: a bool or a dotted recipe field.
    threshold_metric: the metric name of its threshold (None: ``<name>/threshold``; S2T: ``s2t/tau_h``).
    entropy_threshold: its threshold is the entropy threshold ``tau_h`` of the token diagnostics (S2T), which
    otherwise take the recipe's entropy quantile of the population. rows_reorderable: with a ``minibatch`` scope
    its mask does not depend on which micro-batch holds a row, so a packed update may reorder the rows (False for
    a mask without a scope: each micro-batch is its own population).
    The mask's own settings class and section are not fields here: the registry keeps them
    (``TOKEN_MASKS.declared(name)``, given to :func:`register_token_mask`).
    """

    name: str
    fn: Callable
    needs: tuple[str, ...]
    settings: tuple[str, ...]
    population: str
    scope: str | None = None
    selects: bool = False
    renormalize: bool | str = True
    threshold_metric: str | None = None
    entropy_threshold: bool = False
    rows_reorderable: bool = False

    @property
    def metric_name(self) -> str:
        """The metric name of the threshold: ``threshold_metric``, else ``<name>/threshold``."""
        return self.threshold_metric or f"{self.name}/threshold"


# the built-in masks are registered in this module; a new mask is one new module in stapo_jax/algo/token_masks/
TOKEN_MASKS: Registry = Registry("token mask", "actor.token_mask", homes=("stapo_jax.algo.masks",),
                                 packages=("stapo_jax.algo.token_masks",))


def register_token_mask(name: str, *, settings_cls: type | None = None, section: str | None = None,
                        **spec) -> Callable:
    """Decorator registering a mask function under ``name`` (``spec``: the fields of :class:`TokenMask`).

    ``settings_cls``: the mask's own frozen settings dataclass (validating in ``__post_init__``), or None;
    ``section``: the run-config section holding it (also the recipe field the ``settings`` names start with), e.g.
    ``s2t``: the config loader builds it from YAML for every registered mask (:mod:`stapo_jax.config.extensions`)
    and the recipe holds the instance. Both are kept by the registry only (``TOKEN_MASKS.declared(name)``).
    Returns the decorator (the function is stored as a :class:`TokenMask` in ``TOKEN_MASKS``).
    Raises: ValueError if ``name`` is taken, or for ``settings_cls`` without ``section`` (or the reverse);
    TypeError for an unknown ``spec`` field (when the decorator is applied).
    Source: verl ``core_algos.register_policy_loss``."""
    return TOKEN_MASKS.register(name, lambda fn: TokenMask(name=name, fn=fn, **spec),
                                settings_cls=settings_cls, section=section)


def get_token_mask(name: str) -> TokenMask:
    """The registered mask ``name`` (a :class:`TokenMask` record).

    Raises: ConfigError (a ValueError) naming ``actor.token_mask``, the closest registered name and all of them.
    Source: verl ``core_algos.get_policy_loss_fn`` (lookup by name)."""
    return TOKEN_MASKS.lookup(name)


def _nan_if_empty(n, value):
    return jnp.where(n > 0, value, jnp.asarray(jnp.nan, value.dtype))


def _check_same_shape(ref_name, ref, **arrays):
    for name, a in arrays.items():
        if a is None:
            continue
        shape = tuple(a.shape)
        if name == "advantages" and a.ndim == 1 and ref.ndim == 2:
            if shape[0] != ref.shape[0]:
                raise ValueError(f"advantages [B] has B={shape[0]} but {ref_name} is {tuple(ref.shape)}")
            continue
        if shape != tuple(ref.shape):
            raise ValueError(f"{name} shape {shape} must equal {ref_name} shape {tuple(ref.shape)}")


def _tokenwise(advantages, like):
    """[B] or [B, T] advantages -> [B, T]."""
    return advantages[:, None] * jnp.ones_like(like, dtype=advantages.dtype) if advantages.ndim == 1 else advantages


def _gather(x: jax.Array, axis_name) -> jax.Array:
    """Flatten and, if ``axis_name`` is set, concatenate the flattened arrays of all shards (same order)."""
    x = x.reshape(-1)
    if axis_name is None:
        return x
    return jax.lax.all_gather(x, axis_name, tiled=True)


def _kth_largest_count(n: jax.Array, ratio: float) -> jax.Array:
    """k = max(1, ceil(n * ratio)) with the 80/20 code's ``int(n * ratio + 0.9999)`` ceiling (0 when n = 0)."""
    k = jnp.floor(n.astype(jnp.float32) * ratio + 0.9999).astype(jnp.int32)
    return jnp.where(n > 0, jnp.maximum(k, 1), 0)


def masked_quantile(
    values: jax.Array, valid: jax.Array, q: float, method: str = "linear", *, axis_name=None
) -> jax.Array:
    """Exact ``q``-quantile of ``values[valid]`` (over all shards of ``axis_name`` when given).

    Args:
      values: any-shape float array; valid: bool/0-1 array of the same shape.
      q: quantile in [0, 1]. method: ``linear`` (torch.quantile / jnp.quantile default: position
        ``q (n-1)``, linear interpolation), ``nearest`` (position rounded half-to-even, as torch/numpy), or
        ``topk_ceil`` (the ``k``-th largest value with ``k = max(1, ceil((1-q) n))``, the 80/20 code's top-k).
      axis_name: mesh axis name(s) to gather over inside ``shard_map``; None for the local population.

    Returns:
      scalar of ``values.dtype``; NaN when no value is valid (an empty population has no quantile) or when a
      valid value is NaN (as ``torch.quantile``; for every method); a valid ``+inf`` / ``-inf`` is ordered as a
      number, and interpolating towards it gives it (``-inf`` and 2 at weight 0.5: ``-inf``). Ranks are computed
      in float32 (float64 for float64 values).

    Raises:
      ValueError: unknown ``method``, q outside [0, 1], shape mismatch, or non-float ``values``.

    Source: stapo_spec.md §3 and §10 item 4.
    """
    check_one_of("quantile_method", method, QUANTILE_METHODS)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    _check_same_shape("values", values, valid=valid)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise ValueError(f"values must be a float array, got dtype {values.dtype}")
    v = _gather(jax.lax.stop_gradient(values), axis_name)
    ok = _gather(valid.astype(bool), axis_name)
    n = jnp.sum(ok.astype(jnp.int32))
    s = jnp.sort(jnp.where(ok, v, jnp.inf))  # valid values first, ascending (+inf pads tie with a valid +inf)
    last = jnp.maximum(n - 1, 0)
    if method == "topk_ceil":
        k = _kth_largest_count(n, 1.0 - q)
        out = s[jnp.clip(n - k, 0, last)]
    else:
        pos = q * last.astype(jnp.float64 if v.dtype == jnp.float64 else jnp.float32)  # 16-bit: no lost ranks
        if method == "nearest":
            out = s[jnp.clip(jnp.round(pos).astype(jnp.int32), 0, last)]
        else:
            lo = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, last)
            hi = jnp.minimum(lo + 1, last)
            frac = pos - lo.astype(pos.dtype)
            a, b = s[lo].astype(pos.dtype), s[hi].astype(pos.dtype)
            between = jnp.where(jnp.isneginf(a), a, jnp.where(jnp.isposinf(b), b, a + frac * (b - a)))
            out = jnp.where(frac == 0, a, between).astype(v.dtype)  # an infinite end wins: no inf - inf
    out = jnp.where(jnp.any(ok & jnp.isnan(v)), jnp.asarray(jnp.nan, v.dtype), out)  # torch.quantile's rule
    return _nan_if_empty(n, out)


# S2T's threshold metric; the token diagnostics report their entropy threshold under the same name for every
# recipe (stapo_spec.md §7; ``train.mask_strategy.TAU_H_METRIC``)
S2T_TAU_H = "s2t/tau_h"


@register_token_mask("s2t", needs=("log_probs", "entropy", "advantages"),
                     settings=("s2t.tau_p", "s2t.entropy_quantile", "s2t.quantile_method", "s2t.quantile_tokens"),
                     population="valid tokens (s2t.quantile_tokens: or A > 0, or A > 0 and p < tau_p)",
                     scope="s2t.quantile_scope", renormalize="s2t.renormalize", threshold_metric=S2T_TAU_H,
                     entropy_threshold=True, rows_reorderable=True, settings_cls=S2TConfig, section="s2t")
def s2t_mask(
    log_probs: jax.Array,
    entropy: jax.Array,
    advantages: jax.Array,
    response_mask: jax.Array,
    *,
    tau_p: float = 0.002,
    entropy_quantile: float = 0.8,
    quantile_method: str = "linear",
    quantile_tokens: str = "valid",
    axis_name=None,
    tau_h=None,
) -> tuple[jax.Array, jax.Array]:
    """STAPO's Silencing-Spurious-Tokens (S2T) mask.

    A valid token is silenced iff ``A > 0`` and ``p = exp(log_probs) < tau_p`` and ``entropy < tau_h``, where
    ``tau_h`` is the ``entropy_quantile`` quantile of the entropies of the population (valid tokens; valid
    tokens with ``A > 0`` when ``quantile_tokens='positive_adv'``; valid tokens with ``A > 0`` and ``p < tau_p``
    when ``quantile_tokens='candidates'``) of this call, gathered over ``axis_name``.
    Tokens with ``A <= 0`` are never silenced. All inputs are stop-gradient.

    Args:
      log_probs: ``[B, T]`` float, current-policy log-prob of the sampled token (nats, temperature-scaled).
      entropy: ``[B, T]`` float, full-vocabulary entropy at that position (nats).
      advantages: ``[B]`` or ``[B, T]`` float.
      response_mask: ``[B, T]`` 0/1 or bool, valid response tokens.
      tau_p, entropy_quantile, quantile_method, quantile_tokens: see :class:`S2TConfig`.
      axis_name: mesh axis name(s) for the global quantile inside ``shard_map``.
      tau_h: optional scalar entropy threshold to use instead of the population quantile (the train step's
        provisional threshold in ``minibatch_method='correction'``); returned as given.

    Returns:
      ``(keep, tau_h)``: ``keep`` ``[B, T]`` bool (valid and not silenced); ``tau_h`` scalar (NaN if the
      population is empty: then nothing is silenced).

    Raises:
      ValueError: shape mismatches (naming the array) or invalid settings (``tau_p`` outside (0, 1], an unknown
        ``quantile_tokens`` / ``quantile_method``, ``entropy_quantile`` outside [0, 1]).

    Source: STAPO (arXiv 2602.15620) §3-4, Algorithm 1; stapo_spec.md §3.
    """
    _check_same_shape("response_mask", response_mask, log_probs=log_probs, entropy=entropy, advantages=advantages)
    check_one_of("quantile_tokens", quantile_tokens, QUANTILE_TOKENS)
    if isinstance(tau_p, (int, float)) and not 0.0 < tau_p <= 1.0:  # as S2TConfig; a traced tau_p is the caller's
        raise ValueError(f"s2t_mask: tau_p must be in (0, 1] (a probability), got {tau_p}")
    sg = jax.lax.stop_gradient
    log_probs, entropy = sg(log_probs), sg(entropy)
    adv = _tokenwise(sg(advantages), response_mask)
    valid = response_mask.astype(bool)
    population = {"valid": valid, "positive_adv": valid & (adv > 0),
                  "candidates": valid & (adv > 0) & (jnp.exp(log_probs) < tau_p)}[quantile_tokens]
    if tau_h is None:
        tau_h = masked_quantile(entropy, population, entropy_quantile, quantile_method, axis_name=axis_name)
    silenced = valid & (adv > 0) & (jnp.exp(log_probs) < tau_p) & (entropy < tau_h)
    return valid & ~silenced, tau_h


@register_token_mask("top_entropy", needs=("entropy",), settings=("top_entropy.ratio",),
                     population="valid tokens", scope="top_entropy.scope", rows_reorderable=True,
                     settings_cls=TopEntropyConfig, section="top_entropy")
def top_entropy_mask(
    entropy: jax.Array, response_mask: jax.Array, *, ratio: float = 0.2, quantile_method: str = "topk_ceil",
    axis_name=None,
) -> tuple[jax.Array, jax.Array]:
    """20-Entropy mask: keep the ``k = max(1, ceil(ratio * n))`` highest-entropy valid tokens.

    The threshold is the ``k``-th largest valid entropy of the population (gathered over ``axis_name``); a
    valid token is kept iff its entropy is >= the threshold. Without ties this is exactly the official
    ``torch.topk`` selection; with ties at the threshold all tied tokens are kept (so the mask does not
    depend on token order, where ``torch.topk`` breaks ties arbitrarily). ``quantile_method='linear'`` takes
    the threshold as ``torch.quantile(valid entropies, 1 - ratio)`` instead: TRL's ``get_high_entropy_mask``
    (``top_entropy_quantile = ratio``).

    Args:
      entropy: ``[B, T]`` float (nats, stop-gradient). response_mask: ``[B, T]`` 0/1 or bool.
      ratio: fraction in (0, 1]. quantile_method: ``topk_ceil`` (80/20 code) or ``linear`` (TRL), see
      :func:`masked_quantile`. axis_name: mesh axis name(s) inside ``shard_map``.

    Returns: ``(keep, threshold)``: ``keep`` ``[B, T]`` bool (all False when there is no valid token), the entropy
    threshold (NaN when there is none).
    Raises: ValueError on shape mismatch or ratio outside (0, 1].
    Source: Wang et al. 2506.01939; ``get_global_entropy_top_mask`` (Shenzhi-Wang/Beyond-the-80-20-Rule-RLVR).
    """
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    _check_same_shape("response_mask", response_mask, entropy=entropy)
    entropy = jax.lax.stop_gradient(entropy)
    valid = response_mask.astype(bool)
    threshold = masked_quantile(entropy, valid, 1.0 - ratio, quantile_method, axis_name=axis_name)
    return valid & (entropy >= threshold), threshold


def _masked_mean(x, mask):
    m = mask.astype(x.dtype)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1)


@register_token_mask("clip_cov", needs=("log_probs", "old_log_probs", "advantages", "key"),
                     settings=("loss.clip_ratio_low", "loss.clip_ratio_high", "cov.clip_cov_ratio", "cov.clip_cov_lb",
                               "cov.clip_cov_ub"),
                     population="valid, unclipped tokens with clip_cov_lb < cov < clip_cov_ub", renormalize=False,
                     settings_cls=CovConfig, section="cov")
def clip_cov_mask(
    log_probs: jax.Array, old_log_probs: jax.Array, advantages: jax.Array, response_mask: jax.Array, key: jax.Array,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 0.0002,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    priority: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Clip-Cov: detach a random ``max(1, floor(clip_cov_ratio * n))`` of the valid, not-already-clipped tokens
    whose centred covariance ``(A - mean A)(log p - mean log p)`` lies in ``(clip_cov_lb, clip_cov_ub)``.

    Returns ``(keep, threshold)``: ``keep`` ``[B, T]`` bool (valid minus the detached tokens); the smallest
    covariance among the detached tokens (NaN when none is detached). verl keeps detached tokens in the
    denominator: use the objective with ``renormalize=False``. The random choice takes the candidates of highest
    ``priority`` (default: uniform draws from ``key``); verl draws ``torch.randperm`` over the candidates in
    row-major order, so a ``priority`` built from the same permutation replays verl's draw exactly
    (tests/algo/test_peer_parity.py). Local population only.

    Args: log_probs/old_log_probs ``[B, T]`` float; advantages ``[B]``/``[B, T]``; response_mask ``[B, T]``;
      key: a ``jax.random`` key; the clip and cov settings as verl ``policy_loss``; priority: optional
      ``[B, T]`` float >= 0 ranking the candidates (higher is detached first; replaces the draw from ``key``).
    Raises: ValueError on shape mismatch or ``clip_cov_ratio <= 0``.
    Source: Cui et al. 2505.22617; verl ``compute_policy_loss_clip_cov``.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    _check_same_shape("response_mask", response_mask, log_probs=log_probs, old_log_probs=old_log_probs,
                      advantages=advantages)
    sg = jax.lax.stop_gradient
    lp, old, adv = sg(log_probs), sg(old_log_probs), _tokenwise(sg(advantages), response_mask)
    valid = response_mask.astype(bool)
    ratio = jnp.exp(lp - old)
    clipped = (-adv * jnp.clip(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)) > (-adv * ratio)
    cov = (adv - _masked_mean(adv, valid)) * (lp - _masked_mean(lp, valid))
    cand = valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    n = jnp.sum(valid.astype(jnp.int32))
    num = jnp.maximum(jnp.floor(clip_cov_ratio * n.astype(jnp.float32)).astype(jnp.int32), 1)
    draw = jax.random.uniform(key, cand.shape) if priority is None else priority
    score = jnp.where(cand, draw, -1.0)
    thr = jnp.sort(score.reshape(-1))[::-1][jnp.clip(num - 1, 0, score.size - 1)]
    detach = cand & (score >= thr)
    n_det = jnp.sum(detach.astype(jnp.int32))
    threshold = _nan_if_empty(n_det, jnp.min(jnp.where(detach, cov, jnp.asarray(jnp.inf, cov.dtype))))
    return valid & ~detach, threshold


@register_token_mask("kl_cov", needs=("log_probs", "advantages"), settings=("cov.kl_cov_ratio",),
                     population="valid tokens", selects=True, settings_cls=CovConfig, section="cov")
def kl_cov_mask(
    log_probs: jax.Array, advantages: jax.Array, response_mask: jax.Array, *, kl_cov_ratio: float = 0.0002
) -> tuple[jax.Array, jax.Array]:
    """KL-Cov selection: the ``max(1, floor(kl_cov_ratio * n))`` valid tokens of largest centred covariance
    ``(A - mean A)(log p - mean log p)``. Returns ``(selection, threshold)``: a ``[B, T]`` bool *selection*
    (True = gets the KL penalty ``ppo_kl_coef * |log p - log p_old|`` in
    :func:`stapo_jax.algo.objectives.compute_policy_loss`), not a keep mask, and the covariance threshold (the k-th
    largest; NaN when there is no valid token).

    Raises: ValueError on shape mismatch or ``kl_cov_ratio <= 0``.
    Source: Cui et al. 2505.22617; verl ``compute_policy_loss_kl_cov`` (ties: all tied tokens selected).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {kl_cov_ratio}")
    _check_same_shape("response_mask", response_mask, log_probs=log_probs, advantages=advantages)
    sg = jax.lax.stop_gradient
    lp, adv = sg(log_probs), _tokenwise(sg(advantages), response_mask)
    valid = response_mask.astype(bool)
    cov = (adv - _masked_mean(adv, valid)) * (lp - _masked_mean(lp, valid))
    n = jnp.sum(valid.astype(jnp.int32))
    k = jnp.maximum(jnp.floor(kl_cov_ratio * n.astype(jnp.float32)).astype(jnp.int32), 1)
    lo = jnp.asarray(jnp.finfo(cov.dtype).min, cov.dtype)
    s = jnp.sort(jnp.where(valid, cov, lo).reshape(-1))[::-1]
    thr = _nan_if_empty(n, s[jnp.clip(k - 1, 0, s.size - 1)])
    return valid & (cov >= thr), thr
