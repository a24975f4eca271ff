"""The recipe's remaining settings, one frozen dataclass per concept, used both by the library
(:class:`stapo_jax.algo.recipes.Recipe`) and directly as (the base of) a run-config section
(:mod:`stapo_jax.config.schema`): the advantage estimator (``algorithm``), DAPO's dynamic sampling (``sampling``)
and DAPO's overlong reward shaping (the ``overlong_*`` keys of ``reward``). jax-free, so the config loads without
jax. Every invalid value is a :class:`~stapo_jax.core.errors.ConfigError` naming the dotted key.
"""
from __future__ import annotations

from dataclasses import dataclass

from stapo_jax.core.errors import ConfigError
from stapo_jax.core.settings import check_field_types

__all__ = ["AdvantageConfig", "SamplingConfig", "OverlongConfig"]


@dataclass(frozen=True)
class AdvantageConfig:
    """The outcome-advantage estimator (verl ``algorithm.*``; stapo_spec.md §2).

    adv_estimator: a registered estimator's name (``stapo_jax.algo.advantages.ADVANTAGE_ESTIMATORS``: ``grpo``,
    ``dr_grpo``, ``rloo`` and any registered later; the config loader and the
    :class:`~stapo_jax.algo.recipes.Recipe` check the live registry).
    norm_adv_by_std_in_grpo: ``grpo`` divides by the group's std (verl's switch; False gives Dr.GRPO's
    ``R - mean``). std_ddof: 0 or 1, the std's degrees of freedom (verl: 1, ``torch.std``). adv_eps: the std's
    epsilon (> 0; verl 1e-6).
    """

    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    std_ddof: int = 1
    adv_eps: float = 1e-6

    def __post_init__(self):
        check_field_types(self, "algorithm")
        if self.std_ddof not in (0, 1):
            raise ConfigError(f"algorithm.std_ddof={self.std_ddof} must be 0 or 1")
        if not self.adv_eps > 0:
            raise ConfigError(f"algorithm.adv_eps={self.adv_eps} must be > 0")


@dataclass(frozen=True)
class SamplingConfig:
    """DAPO dynamic sampling (Yu et al. 2503.14476 §3.2): drop all-equal-reward groups and refill, at most
    ``max_gen_batches`` rollouts (>= 1); also the ``sampling`` section of the run config."""

    dynamic: bool = False
    max_gen_batches: int = 10

    def __post_init__(self):
        check_field_types(self, "sampling")
        if self.max_gen_batches < 1:
            raise ConfigError(f"sampling.max_gen_batches={self.max_gen_batches} must be >= 1")


@dataclass(frozen=True)
class OverlongConfig:
    """DAPO overlong reward shaping (Yu et al. 2503.14476 §3.4; stapo_spec.md §5): a linear penalty up to
    ``overlong_penalty`` over the last ``overlong_buffer_len`` tokens before the length limit (0 = off); the
    ``overlong_*`` keys of the run config's ``reward`` section."""

    overlong_buffer_len: int = 0
    overlong_penalty: float = 1.0

    def __post_init__(self):
        check_field_types(self, "reward")
        if self.overlong_buffer_len < 0:
            raise ConfigError(f"reward.overlong_buffer_len={self.overlong_buffer_len} must be >= 0")
        if self.overlong_buffer_len > 0 and self.overlong_penalty < 0:
            raise ConfigError(f"reward.overlong_penalty={self.overlong_penalty} must be >= 0")
