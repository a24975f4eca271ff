"""GSPO: the clipped surrogate on the sequence-level importance ratio (Zheng et al. 2507.18071), verl's ``gspo``
``loss_mode``.

``s_i = exp(mean_t (log_probs - old_log_probs))`` over the response's valid tokens; each token carries
``s_{i,t} = sg(s_i) * pi / sg(pi)`` (value ``s_i``, gradient of its own log-prob), ``log s_{i,t}`` clamped above at
10, and the loss is ``max(-A s_{i,t}, -A clip(s_{i,t}, 1 - clip_ratio_low, 1 + clip_ratio_high))`` with no dual
clip, aggregated by ``loss_agg_mode`` (verl recommends ``seq-mean-token-mean``, the paper's). The ratio is taken
over every valid token; a token mask selects the tokens the loss is aggregated over, as for ``vanilla``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stapo_jax.algo.objectives import (PolicyLossConfig, PolicyLossInputs, check_loss_inputs, finish_policy_loss,
                                       metric_pair, register_policy_loss)

__all__ = ["compute_policy_loss_gspo", "LOG_RATIO_MAX"]

LOG_RATIO_MAX = 10.0  # verl: torch.clamp(log_seq_importance_ratio, max=10.0)


@register_policy_loss("gspo")
def compute_policy_loss_gspo(inputs: PolicyLossInputs, config: PolicyLossConfig = PolicyLossConfig()):
    """GSPO's sequence-ratio surrogate as ``(loss_sum, loss_denominator, metrics)``; ``inputs`` (a
    :class:`~stapo_jax.algo.loss_inputs.PolicyLossInputs` of ``[B, T]`` float arrays, nats), ``config``, KL /
    entropy terms and returns as :func:`stapo_jax.algo.objectives.compute_policy_loss`.

    ``clip_ratio_c`` and ``log_ratio_clamp`` do not apply (verl's GSPO has neither); metrics ``pg_clipfrac`` and
    ``ppo_kl`` (over the kept tokens), ``pg_clipfrac_lower`` 0, ``ratio_mean`` (the sequence ratio per token).

    Raises: TypeError / ValueError: as ``compute_policy_loss`` (not a bundle, shapes, dtypes, missing inputs), or
      ValueError for an ``inputs.kl_cov_selection`` (KL-Cov is a ``vanilla`` variant).
    Source: verl 0.9.1 ``core_algos.compute_policy_loss_gspo``; Zheng et al. 2507.18071 eq. (7).
    """
    x = check_loss_inputs(inputs, config)
    if x.kl_cov_selection is not None:
        raise ValueError("policy_loss='gspo' takes no kl_cov_selection (use the vanilla loss with kl_cov)")
    sg, lp, dt = jax.lax.stop_gradient, x.log_probs, x.log_probs.dtype
    delta = lp - x.old
    seq_log_ratio = jnp.sum(delta * x.v, axis=-1) / jnp.maximum(jnp.sum(x.v, axis=-1), 1.0)
    log_ratio = jnp.minimum(lp - sg(lp) + sg(seq_log_ratio)[:, None], LOG_RATIO_MAX)
    ratio = jnp.exp(log_ratio)
    l1 = -x.adv * ratio
    l2 = -x.adv * jnp.clip(ratio, 1 - config.clip_ratio_low, 1 + config.clip_ratio_high)
    clipped = (l2 > l1) & x.valid
    metrics = {"pg_clipfrac": metric_pair(clipped.astype(dt), x.k),
               "pg_clipfrac_lower": (jnp.zeros((), dt), jnp.ones((), dt)),
               "ppo_kl": metric_pair(-delta, x.k), "ratio_mean": metric_pair(sg(ratio), x.k)}
    per_token = {"log_ratio": log_ratio, "ratio": ratio, "clipped": clipped,
                 "clipped_lower": jnp.zeros(lp.shape, bool)}
    return finish_policy_loss(x, jnp.maximum(l1, l2), config, metrics, per_token)
