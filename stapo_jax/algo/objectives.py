"""One clipped policy-gradient surrogate with a token mask, four aggregation modes, KL and entropy terms.

Pure functions on ``[B, T]`` arrays. Every loss returns ``(loss_sum, loss_denominator, metrics)``: the
mini-batch loss is ``sum_k loss_sum_k / D`` where ``D`` is the *global* denominator of the whole mini-batch
(:func:`global_loss_denominator`, or the sum of the returned denominators over micro-batches and shards for
every mode except those in ``CONSTANT_DENOMINATOR_MODES``, whose denominator is a constant).
Dividing once makes micro-batch accumulation and data parallelism exact (conventions.md §2, Tunix
``aggregate_loss``); see :func:`safe_divide`.

Per-token loss (verl ``compute_policy_loss_vanilla``, conventions.md §1.2):
``delta = clip(log_probs - old_log_probs, -20, 20)``, ``r = exp(delta)``,
``l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))``; for ``A < 0`` with dual clip
``l = min(l, -clip_ratio_c A)``; optionally times a truncated importance weight
``min(exp(old_log_probs - rollout_log_probs), rollout_is_threshold)``; plus ``kl_loss_coef * KL`` and minus
``entropy_coeff * entropy``. Numerator mask ``k = response_mask * token_mask``; denominator mask ``k`` (or
``response_mask`` when ``renormalize=False``). The token mask selects policy-gradient tokens only: the KL term is
aggregated over every valid token with its own denominator, as verl's actor and TRL do
(:func:`finish_policy_loss`, :func:`kl_has_own_denominator`).

Metrics are ``{name: (sum, weight)}`` pairs of scalars, so they also accumulate exactly by addition;
:func:`finalize_metrics` turns them into means.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stapo_jax.algo.loss_inputs import (  # noqa: F401  (re-exported: part of this module's API)
    CheckedLossInputs,
    PolicyLossInputs,
    check_loss_inputs,
    loss_masks,
)
from stapo_jax.algo.loss_settings import (  # noqa: F401  (re-exported: part of this module's API)
    CONSTANT_DENOMINATOR_MODES,
    KL_TYPES,
    LOSS_AGG_MODES,
    PolicyLossConfig,
)
from stapo_jax.core.registry import Registry

__all__ = [
    "PolicyLossConfig",
    "LOSS_AGG_MODES",
    "CONSTANT_DENOMINATOR_MODES",
    "KL_TYPES",
    "kl_penalty",
    "kl_loss",
    "aggregate",
    "global_loss_denominator",
    "compute_policy_loss",
    "PolicyLossInputs",
    "CheckedLossInputs",
    "check_loss_inputs",
    "finish_policy_loss",
    "kl_has_own_denominator",
    "metric_pair",
    "POLICY_LOSSES",
    "KL_COV_POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss_fn",
    "safe_divide",
    "finalize_metrics",
    "add_metrics",
]

_SEQ_EPS = 1e-8  # verl agg_loss: s_b / (n_b + 1e-8)


def safe_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den`` with 0 (value and gradient) where ``den == 0``; never NaN. Any broadcastable shapes/dtypes.

    Raises: nothing of its own. Source: the project rule "no NaN from an empty mask" (verl divides by
    ``clamp(den, 1e-8)`` instead, which gives the same 0 for a zero numerator)."""
    ok = den != 0
    return jnp.where(ok, num / jnp.where(ok, den, 1), jnp.zeros_like(num))


def kl_penalty(log_probs: jax.Array, ref_log_probs: jax.Array, kl_type: str) -> jax.Array:
    """Per-token KL estimator between the policy and a reference, ``Delta = log_probs - ref_log_probs``.

    ``kl``/``k1``: Delta; ``abs``: |Delta|; ``mse``/``k2``: Delta^2 / 2; ``low_var_kl``/``k3``:
    ``u = clip(-Delta, -20, 20)``, ``clip(exp(u) - u - 1, -10, 10)``; a ``+`` suffix keeps the named
    estimator's value with the gradient of k2 (straight-through).

    Args: ``[...]`` float arrays of equal shape; kl_type in ``KL_TYPES``.
    Returns: ``[...]`` float. Raises: ValueError for an unknown type or a shape mismatch.
    Source: verl ``kl_penalty_forward`` / ``kl_penalty`` (conventions.md §1.5); Schulman's k1/k2/k3.
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"kl_type must be one of {KL_TYPES}, got {kl_type!r}")
    if tuple(log_probs.shape) != tuple(ref_log_probs.shape):
        raise ValueError(f"ref_log_probs shape {tuple(ref_log_probs.shape)} != log_probs {tuple(log_probs.shape)}")
    base = kl_type.rstrip("+")
    delta = log_probs - ref_log_probs
    if base in ("kl", "k1"):
        value = delta
    elif base == "abs":
        value = jnp.abs(delta)
    elif base in ("mse", "k2"):
        value = 0.5 * delta**2
    else:
        u = jnp.clip(-delta, -20.0, 20.0)
        value = jnp.clip(jnp.exp(u) - u - 1.0, -10.0, 10.0)
    if kl_type.endswith("+"):
        k2 = 0.5 * delta**2
        value = k2 + jax.lax.stop_gradient(value - k2)
    return value


def aggregate(
    loss_mat: jax.Array,
    num_mask: jax.Array,
    den_mask: jax.Array,
    loss_agg_mode: str,
    loss_scale_factor: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """verl ``agg_loss`` as an exact ``(sum, denominator)`` pair for one micro-batch.

    With ``s_b = sum_t L num``, ``n_b = sum_t den``:

    * ``token-mean``: ``(sum_b s_b, sum_b n_b)``
    * ``seq-mean-token-mean``: ``(sum_b s_b / (n_b + 1e-8) [n_b > 0], #{b: n_b > 0})``
    * ``seq-mean-token-sum``: ``(sum_b s_b [n_b > 0], #{b: n_b > 0})``
    * ``token-sum``: ``(sum_b s_b, 1)`` (a constant, not additive)
    * ``seq-mean-token-sum-norm``: ``(sum_b s_b [n_b > 0], #{b: n_b > 0} * (loss_scale_factor or T))``
      (verl >= 0.9.1, PR #4510: the sequence mean of token sums, divided by the horizon; Dr.GRPO)
    * ``token-sum-norm``: ``(sum_b s_b, loss_scale_factor or T)`` (a constant, not additive; verl < 0.9.1's
      ``seq-mean-token-sum-norm``)

    Args:
      loss_mat: ``[B, T]`` float per-token loss. num_mask / den_mask: ``[B, T]`` float 0/1 masks of the
        numerator and the denominator (equal unless masked tokens stay in the count).
      loss_agg_mode: one of ``LOSS_AGG_MODES``. loss_scale_factor: see :class:`PolicyLossConfig`.

    Returns: ``(loss_sum, loss_denominator)`` float scalars.
    Raises: ValueError for an unknown mode or non-2-D inputs.
    Source: verl ``agg_loss`` (conventions.md §1.1) in Tunix's deferred-normalisation form (§2).
    """
    if loss_mat.ndim != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {tuple(loss_mat.shape)}")
    dt = loss_mat.dtype
    s_b = jnp.sum(loss_mat * num_mask.astype(dt), axis=-1)
    n_b = jnp.sum(den_mask.astype(dt), axis=-1)
    nonempty = n_b > 0
    if loss_agg_mode == "token-mean":
        return jnp.sum(s_b), jnp.sum(n_b)
    if loss_agg_mode == "seq-mean-token-mean":
        return jnp.sum(jnp.where(nonempty, s_b / (n_b + _SEQ_EPS), 0.0)), jnp.sum(nonempty.astype(dt))
    if loss_agg_mode == "seq-mean-token-sum":
        return jnp.sum(jnp.where(nonempty, s_b, 0.0)), jnp.sum(nonempty.astype(dt))
    if loss_agg_mode == "token-sum":
        return jnp.sum(s_b), jnp.ones((), dt)
    factor = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return jnp.sum(jnp.where(nonempty, s_b, 0.0)), jnp.sum(nonempty.astype(dt)) * jnp.asarray(factor, dt)
    if loss_agg_mode == "token-sum-norm":
        return jnp.sum(s_b), jnp.asarray(factor, dt)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def global_loss_denominator(
    response_mask: jax.Array, token_mask: jax.Array | None, config: PolicyLossConfig, *, renormalize: bool = True
) -> jax.Array:
    """The denominator ``D`` of a whole mini-batch (pass the full ``[B, T]`` masks, or call per shard and
    ``psum``-then-use for the additive modes). Equals the sum of :func:`compute_policy_loss`'s per-micro-batch
    denominators, except for ``CONSTANT_DENOMINATOR_MODES`` where it is the constant.

    Args: response_mask ``[B, T]``; token_mask ``[B, T]`` bool or None; config; renormalize as the loss.
    Returns: float32 scalar. Raises: ValueError as :func:`aggregate`.
    Source: verl 0.9.1 ``core_algos.agg_loss`` denominators (global-token / sequence normalisation).
    """
    k, d = loss_masks(response_mask, token_mask, renormalize)
    return aggregate(jnp.zeros(k.shape, jnp.float32), k, d, config.loss_agg_mode, config.loss_scale_factor)[1]


def metric_pair(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A deferred-mean metric ``(sum(x * w), sum(w))``; see :func:`finalize_metrics`.

    Args: ``x``, ``w`` broadcastable float arrays (e.g. ``[B, T]`` values and mask). Returns two float scalars.
    Raises: nothing of its own. Source: Tunix ``WeightedMetric`` (sum and weight accumulated separately)."""
    return (jnp.sum(x * w), jnp.sum(w))


def kl_has_own_denominator(config: PolicyLossConfig, has_token_mask: bool, renormalize: bool) -> bool:
    """Whether the KL term's denominator (every valid token) can differ from the policy gradient's (the kept
    tokens): a KL term with a token mask whose masked tokens leave the count, in a mode whose denominator is not a
    constant. Then a sum over micro-batches needs the KL term apart (its own global denominator); otherwise
    :func:`compute_policy_loss`'s ``loss_sum`` holds it exactly.
    Returns a Python bool. Never raises. Source: verl actor ``policy_loss = pg_loss +
    kl_loss_coef * agg_loss(kld, response_mask)`` (two aggregations, two denominators)."""
    return (config.use_kl_loss and config.kl_loss_coef != 0 and has_token_mask and renormalize
            and config.loss_agg_mode not in CONSTANT_DENOMINATOR_MODES)


def finish_policy_loss(x: CheckedLossInputs, pg: jax.Array, config: PolicyLossConfig, metrics: dict,
                       per_token: dict):
    """The part every policy loss shares after its per-token surrogate ``pg`` ``[B, T]`` (float, before masks):
    the truncated sampler importance weight, the aggregation over the kept tokens, the KL term over **every valid
    token** (the token mask selects policy-gradient tokens only) and the entropy bonus.

    The KL term is aggregated over the response mask with its own denominator (``metrics["kl_loss"]``); with
    ``x.fold_kl`` it enters ``loss_sum`` as ``kl_loss_coef * kl_sum * den / kl_den``, so that
    ``safe_divide(loss_sum, den)`` is ``pg + kl_loss_coef * KL`` exactly for a call on the whole mini-batch (and
    for any split into micro-batches unless :func:`kl_has_own_denominator`, where both denominators are equal).
    ``fold_kl=False`` leaves it out (a train step that differentiates the KL term apart). When no token is kept
    (``den = 0``) the folded form cannot carry the KL term; the train step's separate KL gradient still applies.

    Args: x: :class:`CheckedLossInputs` (from :func:`check_loss_inputs`; its ``fold_kl`` / ``return_per_token``
      flags as :class:`PolicyLossInputs`); pg: ``[B, T]`` float; config; metrics: ``{name: (sum, weight)}`` so
      far (the loss's own: clip fractions, ``ppo_kl``, ...); per_token: ``{name: [B, T]}`` so far
      (``log_ratio``, ``ratio``, ``clipped``, ``clipped_lower``).
    Returns: ``(loss_sum, loss_denominator, metrics)`` (+ ``per_token`` with ``x.return_per_token``).
    Raises: ValueError as :func:`aggregate`. Source: verl actor ``ppo_loss`` (pg + kl_coef * agg_loss(kld,
      response_mask) - entropy_coeff * H); stapo_spec.md §5 (``beta agg(KL)`` read over valid tokens).
    """
    sg, dt, k, d, v = jax.lax.stop_gradient, pg.dtype, x.k, x.d, x.v
    if config.rollout_is_threshold is not None:
        w = jnp.minimum(jnp.exp(x.old - x.rollout_log_probs), config.rollout_is_threshold)
        pg = pg * w
        metrics["rollout_is_weight"] = metric_pair(w, k)
    mode, factor = config.loss_agg_mode, config.loss_scale_factor
    pg_sum, den = aggregate(pg, k, d, mode, factor)
    metrics["pg_loss"] = (pg_sum, den)
    loss_sum, total, kl, kl_tok = pg_sum, pg, jnp.zeros_like(pg), jnp.zeros_like(pg)
    if config.use_kl_loss:
        kl = kl_penalty(x.log_probs, x.ref_log_probs, config.kl_loss_type)
        kl_sum, kl_den = aggregate(kl, v, v, mode, factor)
        metrics["kl_loss"] = (kl_sum, kl_den)
        if x.fold_kl:
            scale = safe_divide(sg(den), sg(kl_den))
            loss_sum = loss_sum + config.kl_loss_coef * kl_sum * scale
            kl_tok = config.kl_loss_coef * kl * scale
    if x.entropy is not None:
        metrics["entropy"] = metric_pair(sg(x.entropy), v)
        if config.entropy_coeff != 0:
            ent_sum = aggregate(x.entropy, k, d, mode, factor)[0]
            loss_sum = loss_sum - config.entropy_coeff * ent_sum
            total = total - config.entropy_coeff * x.entropy
            metrics["entropy_loss"] = (ent_sum, den)
    if x.return_per_token:
        zero = jnp.zeros((), dt)
        out = {name: (a if a.dtype == bool else jnp.where(x.valid, a, zero)) for name, a in per_token.items()}
        out.update({"pg_losses": jnp.where(x.valid, pg, zero), "kl": jnp.where(x.valid, kl, zero),
                    "loss": jnp.where(x.valid, total * k + kl_tok, zero)})
        return loss_sum, den, metrics, out
    return loss_sum, den, metrics


def compute_policy_loss(
    inputs: PolicyLossInputs, config: PolicyLossConfig = PolicyLossConfig()
) -> tuple[jax.Array, jax.Array, dict[str, tuple[jax.Array, jax.Array]]]:
    """Clipped surrogate (+ KL, - entropy bonus) as ``(loss_sum, loss_denominator, metrics)``: the ``vanilla``
    policy loss (verl ``loss_mode``).

    Args:
      inputs: :class:`PolicyLossInputs`: ``old_log_probs`` / ``log_probs`` ``[B, T]`` float nats (the gradient
        flows through ``log_probs``), ``advantages`` ``[B]`` or ``[B, T]``, ``response_mask`` ``[B, T]``, and the
        optional ``token_mask``, ``entropy``, ``ref_log_probs``, ``rollout_log_probs``, ``kl_cov_selection``
        (switches to verl's KL-Cov loss ``-A r + ppo_kl_coef |delta| [selected]``, no ratio clip) and the flags
        ``renormalize``, ``fold_kl``, ``return_per_token``. With ``return_per_token`` a fourth value is returned,
        the per-token terms ``{name: [B, T]}`` for loss unit tests: ``log_ratio`` (clamped ``log_probs -
        old_log_probs``), ``ratio``, ``pg_losses`` (the surrogate per token, after the truncated-IS weight, before
        any mask), ``clipped`` (bool: the ratio clip is active, verl's ``pg_losses2 > pg_losses1``),
        ``clipped_lower`` (bool: the dual clip is active; all False without it), ``kl`` (the KL estimator; zeros
        without ``use_kl_loss``), ``loss`` (the per-token numerator terms ``(pg_losses - entropy_coeff * entropy)
        * keep + kl_loss_coef * kl * den / kl_den``). Padding positions hold 0 / False.
      config: :class:`PolicyLossConfig` (clip ratios, ``loss_agg_mode``, KL and entropy terms).

    Returns:
      ``loss_sum``, ``loss_denominator`` (float scalars; loss = ``safe_divide(sum, global denominator)``)
      and metrics ``{name: (sum, weight)}``: ``pg_loss`` (same aggregation as the loss), ``pg_clipfrac``,
      ``pg_clipfrac_lower``, ``ppo_kl``, ``ratio_mean`` (over kept tokens), ``entropy`` (valid tokens),
      ``kl_loss`` (over valid tokens, its own denominator), ``entropy_loss``, ``rollout_is_weight`` when those
      terms are active.

    Raises:
      TypeError: ``inputs`` is not a :class:`PolicyLossInputs`.
      ValueError: a shape mismatch (naming the array), a non-float ``log_probs`` / ``old_log_probs`` /
        ``advantages``, or a required optional input missing.

    Source: verl ``compute_policy_loss_vanilla`` + ``agg_loss`` + ``kl_penalty`` (conventions.md §1);
    dual clip Ye et al. 1912.09729; STAPO objective stapo_spec.md §4.
    """
    x = check_loss_inputs(inputs, config)
    dt, shape, adv, k, valid = x.log_probs.dtype, tuple(x.log_probs.shape), x.adv, x.k, x.valid
    delta = jnp.clip(x.log_probs - x.old, -config.log_ratio_clamp, config.log_ratio_clamp)
    ratio = jnp.exp(delta)
    metrics: dict[str, tuple[jax.Array, jax.Array]] = {}
    clipped = clipped_lower = jnp.zeros(shape, bool)
    if x.kl_cov_selection is None:
        l1 = -adv * ratio
        l2 = -adv * jnp.clip(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
        lc = jnp.maximum(l1, l2)
        clipped = (l2 > l1) & valid
        metrics["pg_clipfrac"] = metric_pair(clipped.astype(dt), k)
        if config.clip_ratio_c is not None:
            l3 = -adv * config.clip_ratio_c
            pg = jnp.where(adv < 0, jnp.minimum(l3, lc), lc)
            clipped_lower = (lc > l3) & (adv < 0) & valid
            metrics["pg_clipfrac_lower"] = metric_pair(clipped_lower.astype(dt), k)
        else:
            pg = lc
    else:
        pg = -adv * ratio + x.kl_cov_selection * config.ppo_kl_coef * jnp.abs(delta)
        metrics["kl_cov_selected_frac"] = metric_pair(x.kl_cov_selection, k)
    metrics["ppo_kl"] = metric_pair(-delta, k)
    metrics["ratio_mean"] = metric_pair(ratio, k)
    per_token = {"log_ratio": delta, "ratio": ratio, "clipped": clipped, "clipped_lower": clipped_lower}
    return finish_policy_loss(x, pg, config, metrics, per_token)


def kl_loss(
    log_probs: jax.Array,
    ref_log_probs: jax.Array,
    response_mask: jax.Array,
    *,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The KL-to-reference term on its own, over every valid token: ``aggregate(kl_penalty(log_probs,
    ref_log_probs), response_mask, response_mask, ...)`` as ``(kl_sum, denominator)`` (the value is
    ``safe_divide(kl_sum, denominator)``; the loss adds ``kl_loss_coef`` times it). Equals the ``kl_loss`` metric
    of :func:`compute_policy_loss` (a token mask does not reach the KL term).

    Args: log_probs / ref_log_probs ``[B, T]`` float (nats; the gradient flows through ``log_probs``);
      response_mask ``[B, T]`` 0/1 or bool; kl_loss_type in ``KL_TYPES``; loss_agg_mode / loss_scale_factor as
      :func:`compute_policy_loss`.
    Returns: float scalars. Raises: ValueError for a shape mismatch, unknown type or mode.
    Source: verl actor ``agg_loss(kl_penalty(log_prob, ref_log_prob), response_mask)`` (``actor.use_kl_loss``).
    """
    if tuple(response_mask.shape) != tuple(log_probs.shape):
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} must equal log_probs {log_probs.shape}")
    valid = response_mask.astype(bool)
    log_probs = jnp.where(valid, log_probs, jnp.zeros((), log_probs.dtype))
    ref = jax.lax.stop_gradient(jnp.where(valid, ref_log_probs, jnp.zeros((), ref_log_probs.dtype)))
    dt = log_probs.dtype
    v = valid.astype(dt)
    return aggregate(kl_penalty(log_probs, ref.astype(dt), kl_loss_type), v, v, loss_agg_mode, loss_scale_factor)


# Policy losses by name (``actor.policy_loss``, verl's ``policy_loss.loss_mode``): every loss is
# ``loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> (loss_sum, loss_denominator, metrics)`` as
# :func:`compute_policy_loss` (the mask and the KL-Cov selection are fields of ``inputs``). ``vanilla`` is
# registered here; every other loss is one module of ``stapo_jax.algo.policy_losses`` (DESIGN.md "Add a policy
# loss"), found by the registry itself.
POLICY_LOSSES: Registry = Registry("policy loss", "actor.policy_loss", homes=("stapo_jax.algo.objectives",),
                                   packages=("stapo_jax.algo.policy_losses",))
POLICY_LOSSES.register("vanilla")(compute_policy_loss)
# the losses that take a selecting mask's ``kl_cov_selection`` (KL-Cov is verl's variant of the vanilla surrogate);
# another loss with a selecting ``actor.token_mask`` is rejected when the config loads
KL_COV_POLICY_LOSSES: set[str] = {"vanilla"}


def register_policy_loss(name: str, takes_kl_cov_selection: bool = False, *, settings_cls: type | None = None,
                         section: str | None = None):
    """Decorator registering a policy loss ``loss(inputs: PolicyLossInputs, config: PolicyLossConfig)`` under
    ``name`` (returns as :func:`compute_policy_loss`: float scalars ``loss_sum``, ``loss_denominator`` and
    ``{name: (sum, weight)}`` metrics, from ``[B, T]`` float arrays);
    ``takes_kl_cov_selection``: it accepts a selecting mask's ``kl_cov_selection`` (:data:`KL_COV_POLICY_LOSSES`).
    ``settings_cls`` / ``section``: settings of its own, a frozen dataclass (validating in ``__post_init__``) read
    from that dotted run-config section (``actor.<name>`` by convention; :mod:`stapo_jax.config.extensions`); the
    loss then takes each field as a keyword, ``loss(inputs, config, **fields)`` (:func:`get_policy_loss_fn` binds
    them; declare them keyword-only without defaults, so that a call without its settings fails loudly).
    Returns the decorator. Raises ValueError if the name is taken, or for ``settings_cls`` without ``section``.
    Source: verl ``core_algos.register_policy_loss``; a loss reading its own keys: verl ``policy_loss.*``."""
    if takes_kl_cov_selection:
        KL_COV_POLICY_LOSSES.add(name)
    return POLICY_LOSSES.register(name, settings_cls=settings_cls, section=section)


def get_policy_loss_fn(name: str, extensions=None):
    """The registered policy loss ``name`` as ``loss(inputs, config)`` (signature and shapes as
    :func:`compute_policy_loss`), with the settings it declares bound as keywords: ``extensions[section]``
    (``Recipe.extensions``, ``{dotted section: settings instance}``), else its ``settings_cls()`` defaults. A loss
    that declares none (every built-in) is returned itself, so it is called exactly as before.
    Raises: ConfigError naming ``actor.policy_loss`` for an unknown name (did-you-mean); TypeError for settings
    of the wrong class. Source: verl ``core_algos.get_policy_loss_fn``; verl ``policy_loss.*`` (its own keys)."""
    return POLICY_LOSSES.bound(name, extensions)


def add_metrics(a: dict, b: dict) -> dict:
    """Accumulate two ``{name: (sum, weight)}`` dicts (micro-batches, shards); values are float scalars.

    Raises: ValueError if the keys differ. Source: Tunix ``WeightedMetric`` accumulation (see :func:`metric_pair`)."""
    if a.keys() != b.keys():
        raise ValueError(f"metric keys differ: {sorted(a)} vs {sorted(b)}")
    return jax.tree.map(jnp.add, a, b)


# the metrics aggregated like the loss (over the kept tokens, the loss's denominator); ``kl_loss`` has its own
LOSS_METRICS = ("pg_loss", "entropy_loss")


def finalize_metrics(metrics: dict, loss_denominator: jax.Array | None = None) -> dict[str, jax.Array]:
    """``{name: (sum, weight)}`` -> ``{name: sum / weight}`` (0 where the weight is 0).

    ``loss_denominator``: the global denominator to use for the loss-type metrics (``LOSS_METRICS``) after
    accumulating micro-batches; needed for ``CONSTANT_DENOMINATOR_MODES``, whose per-call denominator is a
    constant and therefore must not be summed.

    Args: ``metrics`` ``{name: (sum, weight)}`` of float scalars; ``loss_denominator`` float scalar or None.
    Returns ``{name: float scalar}``. Raises: ValueError if an entry is not a ``(sum, weight)`` pair (unpacking).
    Source: verl ``agg_loss`` global-denominator convention (verl 0.9.1), Tunix ``WeightedMetric``.
    """
    out = {}
    for name, (s, w) in metrics.items():
        out[name] = safe_divide(s, loss_denominator if (loss_denominator is not None and name in LOSS_METRICS) else w)
    return out
