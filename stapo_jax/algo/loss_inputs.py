"""What every registered policy loss takes: one typed bundle of arrays and flags, :class:`PolicyLossInputs`.

A policy loss is ``loss(inputs: PolicyLossInputs, config: PolicyLossConfig) -> (loss_sum, loss_denominator,
metrics)`` (verl's ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)``, with the
optional arrays and the aggregation flags carried by the bundle instead of a long parameter list). A new loss
starts with :func:`check_loss_inputs`, which validates the bundle (errors name the array) and returns the cleaned
:class:`CheckedLossInputs` it computes on (padding zeroed, constants stop-gradient, the numerator / denominator
masks built by :func:`loss_masks`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from stapo_jax.algo.loss_settings import PolicyLossConfig

__all__ = ["PolicyLossInputs", "CheckedLossInputs", "check_loss_inputs", "loss_masks"]

_ARRAY_FIELDS = ("old_log_probs", "log_probs", "advantages", "response_mask", "token_mask", "entropy",
                 "ref_log_probs", "rollout_log_probs", "kl_cov_selection")
_FLAG_FIELDS = ("renormalize", "fold_kl", "return_per_token")


@dataclass(frozen=True)
class PolicyLossInputs:
    """The inputs of one policy-loss call on a (micro-)batch of ``B`` responses of ``T`` positions. The first four
    fields are in verl's order (``compute_policy_loss(old_log_prob, log_prob, advantages, response_mask)``);
    name them when building one by hand (``old_log_probs`` before ``log_probs``: swapped, a loss still runs).

    Arrays (a JAX pytree's leaves; the optional ones may be None):
      old_log_probs: ``[B, T]`` float, nats, the policy that produced the rollouts (constant).
      log_probs: ``[B, T]`` float, nats, the current policy (the gradient flows through it).
      advantages: ``[B]`` or ``[B, T]`` float (constant).
      response_mask: ``[B, T]`` 0/1 or bool, the valid response tokens (read as a boolean: any nonzero value is
        one token, never a weight).
      token_mask: ``[B, T]`` bool keep mask (S2T, top-entropy, ...) or None (keep every valid token). It selects
        the policy-gradient tokens only: the KL term covers every valid token (verl, TRL).
      entropy: ``[B, T]`` float, nats; required if ``config.entropy_coeff != 0``; also gives the ``entropy``
        metric (token-mean over valid tokens).
      ref_log_probs: ``[B, T]`` float, nats, the reference policy; required if ``config.use_kl_loss``.
      rollout_log_probs: ``[B, T]`` float, nats, the sampler's; required with ``config.sampler_is='truncate'``.
      kl_cov_selection: ``[B, T]`` bool from :func:`stapo_jax.algo.masks.kl_cov_mask`; switches ``vanilla`` to
        verl's KL-Cov loss ``-A r + ppo_kl_coef |delta| [selected]`` (no ratio clip).

    Flags (static: a pytree's metadata, so a jitted function retraces when they change):
      renormalize: False keeps masked tokens in the denominator (``s2t.renormalize=false``, clip-cov).
      fold_kl: False leaves the KL term out of ``loss_sum`` (:func:`stapo_jax.algo.objectives.finish_policy_loss`).
      return_per_token: the loss also returns its per-token terms ``{name: [B, T]}`` (for loss unit tests).

    The aggregation settings (``loss_agg_mode``, ``loss_scale_factor``) are the loss's config
    (:class:`~stapo_jax.algo.loss_settings.PolicyLossConfig`), as in verl. Construction does not check arrays
    (it also runs on tracers and on pytree placeholders): :func:`check_loss_inputs` does, naming the array.
    Source: verl ``core_algos`` policy-loss signature ``(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode, config)`` (conventions.md §1).
    """

    old_log_probs: jax.Array
    log_probs: jax.Array
    advantages: jax.Array
    response_mask: jax.Array
    token_mask: jax.Array | None = None
    entropy: jax.Array | None = None
    ref_log_probs: jax.Array | None = None
    rollout_log_probs: jax.Array | None = None
    kl_cov_selection: jax.Array | None = None
    renormalize: bool = True
    fold_kl: bool = True
    return_per_token: bool = False


jax.tree_util.register_dataclass(PolicyLossInputs, data_fields=list(_ARRAY_FIELDS), meta_fields=list(_FLAG_FIELDS))


class CheckedLossInputs(NamedTuple):
    """The checked inputs of a policy loss (:func:`check_loss_inputs`): padding zeroed, constants stop-gradient,
    all ``[B, T]`` in the dtype of ``log_probs`` (``adv`` ``[B, 1]`` or ``[B, T]``; the optional ones None when not
    given). ``valid``: bool response tokens; ``k`` / ``d``: the policy-gradient numerator / denominator masks
    (``d`` = ``k``, or ``v`` when masked tokens stay in the count); ``v``: float response mask; ``fold_kl`` /
    ``return_per_token``: the bundle's flags (Python bools)."""

    log_probs: jax.Array
    old: jax.Array
    adv: jax.Array
    entropy: jax.Array | None
    ref_log_probs: jax.Array | None
    rollout_log_probs: jax.Array | None
    kl_cov_selection: jax.Array | None
    valid: jax.Array
    k: jax.Array
    d: jax.Array
    v: jax.Array
    fold_kl: bool = True
    return_per_token: bool = False


def loss_masks(response_mask: jax.Array, token_mask: jax.Array | None,
               renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """The policy-gradient numerator and denominator masks ``(k, d)``, ``[B, T]`` float32.

    ``k = response_mask * token_mask`` (``response_mask`` read as a boolean, so a value of 2 or 0.5 counts once,
    not as a weight); ``d = k``, or the response mask when ``renormalize`` is False (masked tokens stay in the
    count). Args: ``[B, T]`` masks (token_mask bool or None). Raises: nothing of its own (broadcasting errors).
    Source: stapo_spec.md §4 (renormalised S2T objective); verl ``agg_loss`` mask."""
    v = response_mask.astype(bool).astype(jnp.float32)
    k = v if token_mask is None else v * token_mask.astype(v.dtype)
    return k, (k if renormalize else v)


def check_loss_inputs(inputs: PolicyLossInputs, config: PolicyLossConfig) -> CheckedLossInputs:
    """Check and clean the bundle every registered policy loss takes.

    Args: inputs: a :class:`PolicyLossInputs` (``[B, T]`` arrays; advantages ``[B]`` or ``[B, T]``);
      config: the loss's :class:`~stapo_jax.algo.loss_settings.PolicyLossConfig`.
    Returns: a :class:`CheckedLossInputs` (padding positions zeroed before any arithmetic, so neither a value nor a
      gradient can see a NaN there: the "double where" rule).
    Raises: TypeError: ``inputs`` is not a :class:`PolicyLossInputs`. ValueError: a shape mismatch (naming the
      array), a non-float ``log_probs`` / ``old_log_probs`` / ``advantages``, or an input the config needs missing
      (``ref_log_probs`` with ``use_kl_loss``, ``entropy`` with ``entropy_coeff``, ``rollout_log_probs`` with
      ``sampler_is=truncate``).
    Source: verl ``compute_policy_loss_vanilla`` argument conventions (conventions.md §1).
    """
    if not isinstance(inputs, PolicyLossInputs):
        raise TypeError(f"a policy loss takes (inputs: PolicyLossInputs, config), got inputs of type "
                        f"{type(inputs).__name__}")
    log_probs, old_log_probs, advantages = inputs.log_probs, inputs.old_log_probs, inputs.advantages
    if log_probs.ndim != 2:
        raise ValueError(f"log_probs must be [B, T], got shape {tuple(log_probs.shape)}")
    for name, a in (("log_probs", log_probs), ("old_log_probs", old_log_probs), ("advantages", advantages)):
        if not jnp.issubdtype(a.dtype, jnp.floating):  # an int dtype would truncate the others (cast to it)
            raise ValueError(f"{name} must be a float array, got dtype {a.dtype}")
    shape = tuple(log_probs.shape)
    for name in ("old_log_probs", "response_mask", "token_mask", "entropy", "ref_log_probs", "rollout_log_probs",
                 "kl_cov_selection"):
        a = getattr(inputs, name)
        if a is not None and tuple(a.shape) != shape:
            raise ValueError(f"{name} shape {tuple(a.shape)} must equal log_probs shape {shape}")
    if advantages.ndim == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages [B] has B={advantages.shape[0]}, log_probs is {shape}")
        advantages = advantages[:, None]
    elif tuple(advantages.shape) != shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} must be [B] or equal log_probs {shape}")
    if config.use_kl_loss and inputs.ref_log_probs is None:
        raise ValueError("config.use_kl_loss is set but ref_log_probs is None")
    if config.entropy_coeff != 0 and inputs.entropy is None:
        raise ValueError("config.entropy_coeff != 0 but entropy is None")
    if config.rollout_is_threshold is not None and inputs.rollout_log_probs is None:
        raise ValueError("config.sampler_is='truncate' needs rollout_log_probs (the sampler's [B, T] log-probs)")
    sg, dt = jax.lax.stop_gradient, log_probs.dtype
    valid = inputs.response_mask.astype(bool)

    def clean(x):
        return None if x is None else jnp.where(valid, x, jnp.zeros((), x.dtype))

    advantages = clean(advantages)  # [B, 1] broadcasts to [B, T] here
    k, d = loss_masks(inputs.response_mask, inputs.token_mask, inputs.renormalize)
    ref, roll, sel = clean(inputs.ref_log_probs), clean(inputs.rollout_log_probs), inputs.kl_cov_selection
    return CheckedLossInputs(clean(log_probs), sg(clean(old_log_probs)).astype(dt), sg(advantages).astype(dt),
                             clean(inputs.entropy), None if ref is None else sg(ref).astype(dt),
                             None if roll is None else sg(roll).astype(dt),
                             None if sel is None else sel.astype(dt), valid, k.astype(dt), d.astype(dt),
                             valid.astype(dt), inputs.fold_kl, inputs.return_per_token)
