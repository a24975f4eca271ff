"""Token-level diagnostics of STAPO (stapo_spec.md §6): stop-gradient, cheap, returned as metrics.

* Lemma A.1 (exact): for the unnormalised per-token surrogate ``J = w log pi(y)`` with weight ``w``,
  ``grad_z J = w (e_y - pi)`` so ``||grad_z J||^2 = w^2 (1 - 2p + C) = w^2 ((1 - p)^2 + C')``, ``C = sum_v pi_v^2``,
  ``C' = sum_{v != y} pi_v^2``; the second form is what is computed (no cancellation in float32 as p -> 1).
* Theorem 3.1 (bounds): ``w^2 (1 - 2p + e^{-H}) <= ||grad_z J||^2 <= w^2 (2 - 2p - C_V H^2)`` with
  ``C_V = (|V| - 1) / (|V| (ln |V|)^2)``.
* Phase cells: probability (``p < tau_p`` low) x advantage sign x entropy (``H < tau_h`` low); the cell
  ``p low, A > 0, H low`` holds the spurious tokens S2T silences.

``w`` is 0 for a clipped token (``A > 0, r > 1 + eps_high`` or ``A < 0, r < 1 - eps_low``, and the dual-clipped
``A < 0, r > c``) and for a token whose log-ratio lies outside the ``±log_ratio_clamp`` clamp (verl's ±20: the
clamp's gradient is 0 there), otherwise ``r A`` (the 1/N factor is left out). Gradients here are w.r.t. the tempered logits
``z = logits / T``; w.r.t. the raw logits they are ``1/T`` times as large.

Metrics use the ``{name: (sum, weight)}`` convention of ``objectives.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from stapo_jax.algo.objectives import metric_pair

__all__ = [
    "vocab_constant",
    "collision_probability",
    "surrogate_weight",
    "gradient_norm_sq",
    "gradient_norm_bounds",
    "PHASE_CELLS",
    "token_diagnostics",
]


def vocab_constant(vocab_size: int) -> float:
    """``C_V = (|V| - 1) / (|V| (ln |V|)^2)`` of Theorem 3.1 (7.0247e-3 for |V| = 151,936).

    Args: ``vocab_size`` int. Returns a Python float scalar (unitless; multiplies ``H^2`` in nats^2).
    Raises: ValueError for ``vocab_size < 2``. Source: STAPO (arXiv 2602.15620) Theorem 3.1.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return (vocab_size - 1) / (vocab_size * math.log(vocab_size) ** 2)


def collision_probability(logits: jax.Array, temperature: float = 1.0, token_ids: jax.Array | None = None) -> jax.Array:
    """``C = sum_v softmax(logits / T)_v^2``, or with ``token_ids`` ``C' = sum_{v != y} softmax(logits / T)_v^2``
    (the other tokens only, summed directly so that it keeps its relative precision as ``p_y -> 1``).

    Args: logits ``[..., V]`` float; token_ids ``[...]`` int (optional). Returns ``[...]`` float32 (float64 for
    float64 logits). Rényi-2: ``C >= e^{-H}``. The chunked pass gives ``C'`` without ``[..., V]`` logits
    (``chunked_log_probs_and_entropy(..., with_collision=True)``). Source: STAPO Lemma A.1.
    Raises: nothing of its own (mismatched ``token_ids`` shapes fail in broadcasting).
    """
    p = jax.nn.softmax(logits.astype(jnp.float64 if logits.dtype == jnp.float64 else jnp.float32) / temperature, -1)
    sq = p * p
    if token_ids is not None:
        sq = jnp.where(token_ids[..., None] == jnp.arange(p.shape[-1]), 0.0, sq)
    return jnp.sum(sq, axis=-1)


def surrogate_weight(
    log_ratio: jax.Array,
    advantages: jax.Array,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> jax.Array:
    """Per-token weight ``w = d l / d log_probs`` (up to sign): 0 where the clipped surrogate is flat in the
    log-probability, else ``r A`` with ``r = exp(log_ratio)``.

    Flat: the ratio clip (``A > 0, r > 1 + eps_high``; ``A < 0, r < 1 - eps_low``), the dual clip (``A < 0,
    r > c``) and the log-ratio clamp (``|log_ratio| > log_ratio_clamp``, where verl's ``clamp(-20, 20)`` has a zero
    gradient).

    Args: log_ratio ``[B, T]`` float (``log_probs - old_log_probs``, *before* the clamp), advantages ``[B, T]`` or
      ``[B]``, clip settings as ``PolicyLossConfig``. Returns ``[B, T]`` float.
    Raises: nothing of its own (shape mismatches fail in broadcasting).
    Source: stapo_spec.md §6; verl ``compute_policy_loss_vanilla`` (clamp, dual clip).
    """
    adv = advantages[:, None] if advantages.ndim == 1 and log_ratio.ndim == 2 else advantages
    ratio = jnp.exp(jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp))
    clipped = ((adv > 0) & (ratio > 1 + clip_ratio_high)) | ((adv < 0) & (ratio < 1 - clip_ratio_low))
    if clip_ratio_c is not None:
        clipped = clipped | ((adv < 0) & (ratio > clip_ratio_c))
    clipped = clipped | (jnp.abs(log_ratio) > log_ratio_clamp)
    return jnp.where(clipped, 0.0, ratio * adv)


def gradient_norm_sq(log_probs: jax.Array, collision_others: jax.Array, w: jax.Array) -> jax.Array:
    """Lemma A.1: ``||grad_z (w log pi(y))||^2 = w^2 ((1 - p)^2 + C')``, ``C' = sum_{v != y} pi_v^2``.

    ``1 - p`` is ``-expm1(log_probs)`` and ``C'`` excludes the sampled token, so nothing cancels as ``p -> 1``
    (the textbook ``1 - 2p + C`` loses every digit in float32 there).
    Args: log_probs (nats), collision_others (from :func:`collision_probability` with ``token_ids`` or the chunked
    pass), w: broadcastable float arrays. Returns their broadcast shape. Source: STAPO Lemma A.1.
    Raises: nothing of its own (shapes that do not broadcast fail in JAX).
    """
    one_minus_p = -jnp.expm1(log_probs)
    return w * w * (one_minus_p * one_minus_p + collision_others)


def gradient_norm_bounds(p: jax.Array, entropy: jax.Array, w: jax.Array, vocab_size: int):
    """Theorem 3.1: ``(w^2 (1 - 2p + e^{-H}), w^2 (2 - 2p - C_V H^2))`` (lower, upper bound).

    Args: ``p`` probability of the sampled token, ``entropy`` (nats), ``w`` weight: broadcastable float arrays
    (e.g. ``[B, T]``); ``vocab_size`` int. Returns two arrays of their broadcast shape.
    Raises: ValueError for ``vocab_size < 2`` (from :func:`vocab_constant`).
    Source: STAPO (arXiv 2602.15620) Theorem 3.1.
    """
    w2 = w * w
    return w2 * (1.0 - 2.0 * p + jnp.exp(-entropy)), w2 * (2.0 - 2.0 * p - vocab_constant(vocab_size) * entropy**2)


PHASE_CELLS = tuple(f"{pp}_{a}_{h}" for pp in ("plow", "phigh") for a in ("apos", "aneg") for h in ("hlow", "hhigh"))


def token_diagnostics(
    log_probs: jax.Array,
    entropy: jax.Array,
    advantages: jax.Array,
    old_log_probs: jax.Array,
    response_mask: jax.Array,
    token_mask: jax.Array | None,
    *,
    tau_p: float,
    tau_h: jax.Array,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None = None,
    vocab_size: int | None = None,
    collision_others: jax.Array | None = None,
    log_ratio_clamp: float = 20.0,
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Phase-cell fractions, S2T fractions and gradient-norm statistics as ``{name: (sum, weight)}``.

    Args:
      log_probs, entropy, old_log_probs: ``[B, T]`` float (current policy p and H; nats). advantages: ``[B]`` or
        ``[B, T]``. response_mask: ``[B, T]`` valid tokens. token_mask: the keep mask actually applied (or None).
      tau_p: probability threshold; tau_h: entropy threshold (scalar, e.g. the S2T quantile).
      clip settings: as ``PolicyLossConfig``. vocab_size: |V| for the Theorem 3.1 bounds (omit to skip them).
      collision_others: ``[B, T]`` ``sum_{v != y} pi_v^2`` (``chunked_log_probs_and_entropy(..., with_collision=True)``)
        for the exact Lemma A.1 norm ``g = (1 - p)^2 + C'`` (omit to skip it).

    Returns (all weights are token counts over valid tokens unless noted):
      ``s2t/masked_frac`` (valid tokens not kept), ``s2t/frac_pos_lowp`` (A > 0 and p < tau_p),
      ``s2t/frac_below_tau_h``, ``s2t/n_keep`` (sum over kept tokens, weight 1), ``phase/<cell>/frac``,
      and with ``collision_others``: ``grad/g_mean``, ``grad/w2g_mean``, ``phase/<cell>/g_mean``,
      ``phase/<cell>/w2g_mean`` (weight = tokens in the cell), with ``vocab_size``: ``grad/bound_lower_mean``,
      ``grad/bound_upper_mean``, ``grad/bounds_violated`` (count of tokens outside the bounds; weight 1).

    Raises: ValueError on shape mismatch.
    Source: STAPO (arXiv 2602.15620) Lemma A.1, Theorem 3.1, phase table; stapo_spec.md §6.
    """
    shape = tuple(log_probs.shape)
    for name, a in dict(entropy=entropy, old_log_probs=old_log_probs, response_mask=response_mask,
                        token_mask=token_mask, collision_others=collision_others).items():
        if a is not None and tuple(a.shape) != shape:
            raise ValueError(f"{name} shape {tuple(a.shape)} must equal log_probs shape {shape}")
    sg = jax.lax.stop_gradient
    lp, ent, old = sg(log_probs), sg(entropy), sg(old_log_probs)
    dt = lp.dtype
    adv = sg(advantages)
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, shape).astype(dt)
    v = response_mask.astype(bool).astype(dt)  # nonzero = one response token, as compute_policy_loss reads it
    keep = v if token_mask is None else v * token_mask.astype(dt)
    p = jnp.exp(lp)
    low_p, low_h = p < tau_p, ent < tau_h
    out = {
        "s2t/masked_frac": metric_pair(1.0 - keep, v),
        "s2t/frac_pos_lowp": metric_pair(((adv > 0) & low_p).astype(dt), v),
        "s2t/frac_below_tau_h": metric_pair(low_h.astype(dt), v),
        "s2t/n_keep": (jnp.sum(keep), jnp.ones((), dt)),
    }
    cells = {}
    for cell in PHASE_CELLS:
        pp, a, h = cell.split("_")
        sel = (low_p if pp == "plow" else ~low_p) & ((adv > 0) if a == "apos" else (adv < 0))
        sel = sel & (low_h if h == "hlow" else ~low_h)
        cells[cell] = sel.astype(dt) * v
        out[f"phase/{cell}/frac"] = metric_pair(cells[cell], v)
    w = surrogate_weight(lp - old, adv, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                         clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp)
    if collision_others is not None:
        g = gradient_norm_sq(lp, sg(collision_others).astype(dt), 1.0)
        w2g = w * w * g
        out["grad/g_mean"] = metric_pair(g, v)
        out["grad/w2g_mean"] = metric_pair(w2g, v)
        for cell, sel in cells.items():
            out[f"phase/{cell}/g_mean"] = metric_pair(g, sel)
            out[f"phase/{cell}/w2g_mean"] = metric_pair(w2g, sel)
    if vocab_size is not None:
        lo, hi = gradient_norm_bounds(p, ent, w, vocab_size)
        out["grad/bound_lower_mean"] = metric_pair(lo, v)
        out["grad/bound_upper_mean"] = metric_pair(hi, v)
        if collision_others is not None:
            exact = w2g
            tol = 1e-5 * (1.0 + w * w)
            bad = ((exact < lo - tol) | (exact > hi + tol)).astype(dt)
            out["grad/bounds_violated"] = (jnp.sum(bad * v), jnp.ones((), dt))
    return out
