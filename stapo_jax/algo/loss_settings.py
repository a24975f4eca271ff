"""The policy-loss settings, one frozen dataclass used both by the library (:mod:`stapo_jax.algo.objectives`,
:class:`stapo_jax.algo.recipes.Recipe`) and directly as the loss keys of the run config's ``actor`` section
(:class:`stapo_jax.config.schema.ActorConfig` extends it with the PPO batching and optimizer keys). jax-free, so
the config loads without jax. Key names are verl's (``verl/trainer/config/actor/actor.yaml``); every invalid value
is a :class:`~stapo_jax.core.errors.ConfigError` naming the dotted key ``actor.<field>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from stapo_jax.core.errors import ConfigError
from stapo_jax.core.settings import check_field_types, check_one_of

__all__ = ["PolicyLossConfig", "LOSS_AGG_MODES", "CONSTANT_DENOMINATOR_MODES", "KL_TYPES", "SAMPLER_IS_MODES"]

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm", "token-sum-norm"]
KLType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+",
                 "low_var_kl+", "k3+"]
SamplerIS = Literal["off", "truncate"]
LOSS_AGG_MODES = get_args(LossAggMode)
KL_TYPES = get_args(KLType)
SAMPLER_IS_MODES = get_args(SamplerIS)
# modes whose denominator is a constant (not a sum over micro-batches / shards): accumulate it once, not K times
CONSTANT_DENOMINATOR_MODES = ("token-sum", "token-sum-norm")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Loss settings, verl actor key names (``verl/trainer/config/actor/actor.yaml``); library defaults are verl
    0.9.1's (the run config's ``actor`` section sets the project's recipe defaults).

    clip_ratio_low / clip_ratio_high: epsilon_low / epsilon_high of the ratio clip.
    clip_ratio_c: dual-clip constant (> 1) for ``A < 0``, or None to disable (verl always applies 3.0).
    loss_agg_mode: one of ``LOSS_AGG_MODES`` (verl 0.9.1 ``agg_loss`` semantics; ``token-sum-norm`` is the
    pre-0.9.1 ``seq-mean-token-sum-norm``, kept as an explicit option). loss_scale_factor: the per-sequence
    horizon of ``seq-mean-token-sum-norm`` / ``token-sum-norm`` (None: the mask's last dimension, verl's default).
    log_ratio_clamp: |log ratio| clamp before exp (verl 20). entropy_coeff: entropy bonus coefficient (>= 0).
    use_kl_loss / kl_loss_coef / kl_loss_type: KL-to-reference term (``KL_TYPES``; coefficient >= 0).
    sampler_is / sampler_is_cap: truncated importance sampling on the sampler's log-probs (Tunix ``GRPOConfig``
    switch): ``truncate`` multiplies each token by ``min(exp(old - rollout), sampler_is_cap)`` (cap >= 1);
    :attr:`rollout_is_threshold` is that cap, or None when off.
    ppo_kl_coef: KL-Cov penalty coefficient (used only with a ``kl_cov_selection``; verl
    ``policy_loss.ppo_kl_coef`` default 0.1; this project used 1.0 before verl 0.9.1 parity).

    Raises: ConfigError (a ValueError) naming ``actor.<field>`` for any invalid value.
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    loss_agg_mode: LossAggMode = "token-mean"
    loss_scale_factor: Optional[float] = None
    log_ratio_clamp: float = 20.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: KLType = "low_var_kl"
    sampler_is: SamplerIS = "off"
    sampler_is_cap: float = 2.0
    ppo_kl_coef: float = 0.1

    def __post_init__(self):
        check_field_types(self, "actor")  # the subclass's (ActorConfig's) fields too
        check_one_of("actor.loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_one_of("actor.kl_loss_type", self.kl_loss_type, KL_TYPES)
        check_one_of("actor.sampler_is", self.sampler_is, SAMPLER_IS_MODES)
        _need(0 <= self.clip_ratio_low < 1, "clip_ratio_low", self.clip_ratio_low, "must be in [0, 1)")
        _need(self.clip_ratio_high >= 0, "clip_ratio_high", self.clip_ratio_high, "must be >= 0")
        _need(self.clip_ratio_c is None or self.clip_ratio_c > 1.0, "clip_ratio_c", self.clip_ratio_c,
              "must be > 1 (dual clip), or null to turn it off")
        _need(self.loss_scale_factor is None or self.loss_scale_factor > 0, "loss_scale_factor",
              self.loss_scale_factor, "must be > 0 or null")
        _need(self.log_ratio_clamp > 0, "log_ratio_clamp", self.log_ratio_clamp, "must be > 0")
        _need(self.entropy_coeff >= 0, "entropy_coeff", self.entropy_coeff, "must be >= 0")
        _need(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "must be >= 0")
        _need(self.sampler_is_cap >= 1, "sampler_is_cap", self.sampler_is_cap, "must be >= 1")
        _need(self.ppo_kl_coef >= 0, "ppo_kl_coef", self.ppo_kl_coef, "must be >= 0")

    @property
    def rollout_is_threshold(self) -> Optional[float]:
        """The truncated importance weight's cap: ``sampler_is_cap`` with ``sampler_is=truncate``, else None."""
        return self.sampler_is_cap if self.sampler_is == "truncate" else None


def _need(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ConfigError(f"actor.{field}={value} {rule}")
