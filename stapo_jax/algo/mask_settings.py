"""The settings of the token masks, one frozen dataclass per concept, used both by the library
(:mod:`stapo_jax.algo.masks`, :class:`stapo_jax.algo.recipes.Recipe`) and directly as the ``s2t`` / ``top_entropy`` sections
of the run config (:mod:`stapo_jax.config.schema`). jax-free, so the config loads without jax. Every invalid value is a
:class:`~stapo_jax.core.errors.ConfigError` naming the dotted key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from stapo_jax.core.errors import ConfigError
from stapo_jax.core.settings import check_field_types, check_one_of

__all__ = ["S2TConfig", "TopEntropyConfig", "CovConfig", "QUANTILE_METHODS", "QUANTILE_SCOPES", "QUANTILE_TOKENS"]

QUANTILE_METHODS = ("linear", "nearest", "topk_ceil")
QUANTILE_SCOPES = ("microbatch", "minibatch")
QUANTILE_TOKENS = ("valid", "positive_adv", "candidates")


@dataclass(frozen=True)
class S2TConfig:
    """STAPO's S2T mask settings (stapo_spec.md §3 and §10 items 1-6; defaults are the adopted reading); also the
    ``s2t`` section of the run config.

    enabled: the run uses the S2T mask: derived from ``actor.token_mask`` by the config loader (the older YAML
    spelling ``s2t.enabled`` is still read, with a deprecation note; a recipe's ``token_mask`` decides for the
    library).
    tau_p: absolute probability threshold (silence if p < tau_p). entropy_quantile: q of tau_h = Q_q(H).
    quantile_scope: 'minibatch' (pre-pass, global over devices and micro-batches) or 'microbatch'.
    quantile_tokens: 'valid' (all valid response tokens), 'positive_adv' (valid, A > 0) or 'candidates' (valid,
    A > 0 and p < tau_p: stapo_spec.md §10 row 3, one reading of the paper's v1). quantile_method: 'linear'
    (torch.quantile default), 'nearest' or 'topk_ceil' (80/20 code). stats_policy: 'current' or 'old'
    (policy giving p and H). minibatch_method: how the train step gets the exact mini-batch ``tau_h`` under the
    current policy: 'correction' (mask with the old-policy quantile during the gradient pass, then redo forward +
    backward only for micro-batches where the exact quantile changes a token's mask) or 'prepass' (one extra
    forward over the mini-batch first, stapo_spec §3). renormalize: masked tokens leave the denominator too.
    """

    enabled: bool = True
    tau_p: float = 0.002
    entropy_quantile: float = 0.8
    quantile_scope: Literal["minibatch", "microbatch"] = "minibatch"
    quantile_tokens: Literal["valid", "positive_adv", "candidates"] = "valid"
    quantile_method: Literal["linear", "nearest", "topk_ceil"] = "linear"
    stats_policy: Literal["current", "old"] = "current"
    minibatch_method: Literal["correction", "prepass"] = "correction"
    renormalize: bool = True

    def __post_init__(self):
        check_field_types(self, "s2t")
        if not 0.0 < self.tau_p <= 1.0:
            raise ConfigError(f"s2t.tau_p must be in (0, 1], got {self.tau_p}")
        if not 0.0 <= self.entropy_quantile <= 1.0:
            raise ConfigError(f"s2t.entropy_quantile must be in [0, 1], got {self.entropy_quantile}")
        check_one_of("s2t.quantile_scope", self.quantile_scope, QUANTILE_SCOPES)
        check_one_of("s2t.quantile_tokens", self.quantile_tokens, QUANTILE_TOKENS)
        check_one_of("s2t.quantile_method", self.quantile_method, QUANTILE_METHODS)
        check_one_of("s2t.stats_policy", self.stats_policy, ("current", "old"))
        check_one_of("s2t.minibatch_method", self.minibatch_method, ("correction", "prepass"))


@dataclass(frozen=True)
class TopEntropyConfig:
    """20-Entropy (Wang et al. 2506.01939) settings: keep the top ``ratio`` of valid tokens by entropy; also the
    ``top_entropy`` section of the run config.

    enabled: the run uses this mask: derived from ``actor.token_mask`` (as ``S2TConfig.enabled``).
    scope: 'minibatch' (our default, stapo_spec.md §10 item 12) or
    'microbatch' (official code).
    """

    enabled: bool = False
    ratio: float = 0.2
    scope: Literal["minibatch", "microbatch"] = "minibatch"

    def __post_init__(self):
        check_field_types(self, "top_entropy")
        if not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"top_entropy.ratio must be in (0, 1], got {self.ratio}")
        check_one_of("top_entropy.scope", self.scope, QUANTILE_SCOPES)


@dataclass(frozen=True)
class CovConfig:
    """Clip-Cov / KL-Cov selection settings (Cui et al. 2505.22617); also the ``cov`` section of the run config,
    shared by the ``clip_cov`` and ``kl_cov`` masks. Key names and defaults are verl 0.9.1's
    ``actor.policy_loss.clip_cov_ratio`` / ``clip_cov_lb`` / ``clip_cov_ub`` / ``kl_cov_ratio`` (our
    ``actor.policy_loss`` is the loss's name, so the keys live in the mask's own section, as ``s2t`` /
    ``top_entropy``). The KL-Cov penalty coefficient is ``actor.ppo_kl_coef`` (``PolicyLossConfig``).

    clip_cov_ratio / kl_cov_ratio: fraction of valid tokens detached / penalised, in (0, 1].
    clip_cov_lb < clip_cov_ub: the covariance window of Clip-Cov's candidates (unitless covariance of A and log p).
    Raises: ConfigError naming ``cov.<key>`` for an invalid value.
    """

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002

    def __post_init__(self):
        check_field_types(self, "cov")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0.0 < getattr(self, key) <= 1.0:
                raise ConfigError(f"cov.{key}={getattr(self, key)} must be in (0, 1]")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise ConfigError(f"cov.clip_cov_lb={self.clip_cov_lb} must be < cov.clip_cov_ub={self.clip_cov_ub}")
