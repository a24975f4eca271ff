"""Named presets: ``grpo``, ``dapo``, ``entropy20``, ``justrl``, ``stapo`` (stapo_spec.md §4, §5, §10).

A recipe is a frozen :class:`Recipe`: the loss settings (:class:`~stapo_jax.objectives.PolicyLossConfig`,
verl key names), the token mask and its settings (:class:`~stapo_jax.masks.S2TConfig`,
:class:`~stapo_jax.masks.TopEntropyConfig`), the advantage estimator, and DAPO's sampling/reward hooks.
Every method shares one clipped surrogate; they differ only in the fields below (stapo_spec.md §5 table):

========== ============ ============== =========== ===== ===== ============ =========
recipe     clip low/hi  mask           aggregation KL    H bon dyn sampling overlong
========== ============ ============== =========== ===== ===== ============ =========
grpo       0.2 / 0.2    none           token-mean  0     0     no           no
entropy20  0.2 / 0.28   top 20% H      token-mean  0     0     no           no
justrl     0.2 / 0.28   none           token-mean  0     0     no           no
dapo       0.2 / 0.28   none           token-mean  0     0     yes          4096, 1.0
stapo      0.2 / 0.28   S2T            token-mean  0     0     no           no
========== ============ ============== =========== ===== ===== ============ =========

All use dual clip ``clip_ratio_c = 10`` (JustRL script; stapo_spec.md §10 item 7; verl's default is 3) and
GRPO advantages (ddof 1, epsilon 1e-6).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from stapo_jax import masks
from stapo_jax.masks import CovConfig, S2TConfig, TopEntropyConfig
from stapo_jax.objectives import PolicyLossConfig

__all__ = ["Recipe", "RECIPES", "TOKEN_MASKS", "get_recipe", "compute_token_mask"]

TOKEN_MASKS = ("none", "s2t", "top_entropy", "clip_cov", "kl_cov")
_ADV = ("grpo", "dr_grpo", "rloo")


@dataclass(frozen=True)
class Recipe:
    """One RL method's settings.

    name: recipe name. loss: surrogate settings (verl names). token_mask: one of ``TOKEN_MASKS``.
    s2t / top_entropy / cov: settings of the corresponding masks. adv_estimator: ``grpo``, ``dr_grpo`` or
    ``rloo``; adv_epsilon, adv_ddof: GRPO std epsilon and ddof. dynamic_sampling / max_gen_batches: DAPO's
    drop-constant-groups resampling. overlong_buffer_len / overlong_penalty_factor: DAPO overlong reward
    shaping (0 = off). drop_truncated: give truncated responses an all-zero response mask.
    """

    name: str
    loss: PolicyLossConfig
    token_mask: str = "none"
    s2t: S2TConfig = field(default_factory=S2TConfig)
    top_entropy: TopEntropyConfig = field(default_factory=TopEntropyConfig)
    cov: CovConfig = field(default_factory=CovConfig)
    adv_estimator: str = "grpo"
    adv_epsilon: float = 1e-6
    adv_ddof: int = 1
    dynamic_sampling: bool = False
    max_gen_batches: int = 10
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    drop_truncated: bool = False

    def __post_init__(self):
        if self.token_mask not in TOKEN_MASKS:
            raise ValueError(f"token_mask must be one of {TOKEN_MASKS}, got {self.token_mask!r}")
        if self.adv_estimator not in _ADV:
            raise ValueError(f"adv_estimator must be one of {_ADV}, got {self.adv_estimator!r}")
        if self.adv_ddof not in (0, 1):
            raise ValueError(f"adv_ddof must be 0 or 1, got {self.adv_ddof}")
        if self.max_gen_batches < 1:
            raise ValueError(f"max_gen_batches must be >= 1, got {self.max_gen_batches}")
        if self.overlong_buffer_len < 0:
            raise ValueError(f"overlong_buffer_len must be >= 0, got {self.overlong_buffer_len}")

    @property
    def renormalize(self) -> bool:
        """Whether masked tokens leave the denominator (False only for S2T with renormalize=false and Clip-Cov)."""
        if self.token_mask == "s2t":
            return self.s2t.renormalize
        return self.token_mask != "clip_cov"

    def replace(self, **changes) -> "Recipe":
        """``dataclasses.replace``; nested sections accept dicts, e.g. ``replace(loss={"clip_ratio_c": None})``."""
        for section in ("loss", "s2t", "top_entropy", "cov"):
            if isinstance(changes.get(section), dict):
                changes[section] = dataclasses.replace(getattr(self, section), **changes[section])
        return dataclasses.replace(self, **changes)


_CLIP_HIGHER = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean",
                    entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.0)

RECIPES: dict[str, Recipe] = {
    "grpo": Recipe("grpo", PolicyLossConfig(**{**_CLIP_HIGHER, "clip_ratio_high": 0.2})),
    "entropy20": Recipe("entropy20", PolicyLossConfig(**_CLIP_HIGHER), token_mask="top_entropy"),
    "justrl": Recipe("justrl", PolicyLossConfig(**_CLIP_HIGHER)),
    "dapo": Recipe("dapo", PolicyLossConfig(**_CLIP_HIGHER), dynamic_sampling=True, overlong_buffer_len=4096,
                   overlong_penalty_factor=1.0),
    "stapo": Recipe("stapo", PolicyLossConfig(**_CLIP_HIGHER), token_mask="s2t"),
}


def get_recipe(name: str, **changes) -> Recipe:
    """The named preset, optionally with fields changed (see :meth:`Recipe.replace`).

    Raises: ValueError for an unknown name (lists the known ones) or an invalid changed value.
    Source: stapo_spec.md §4-5, §10; JustRL ``run_scaling_ssh_distill.sh``; DAPO 2503.14476.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    recipe = RECIPES[name]
    return recipe.replace(**changes) if changes else recipe


def compute_token_mask(
    recipe: Recipe,
    *,
    log_probs,
    entropy,
    advantages,
    response_mask,
    old_log_probs=None,
    key=None,
    axis_name=None,
    tau_h=None,
):
    """The recipe's token mask on this population (all inputs stop-gradient).

    Args:
      recipe: a :class:`Recipe`. log_probs / entropy / response_mask: ``[B, T]``; advantages ``[B]`` or
        ``[B, T]``; old_log_probs ``[B, T]`` (Clip-Cov only); key: PRNG key (Clip-Cov only); axis_name: mesh
        axes to gather the threshold population over (inside ``shard_map``); tau_h: S2T only, a given entropy
        threshold instead of the population quantile (see :func:`stapo_jax.masks.s2t_mask`).

    Returns:
      ``(keep, stats)``: ``keep`` ``[B, T]`` bool or None (no mask; for ``kl_cov`` it is the KL-Cov
      *selection*, passed to the objective as ``kl_cov_selection``); ``stats`` dict of scalars
      (``s2t/tau_h`` for S2T).

    Raises: ValueError when Clip-Cov lacks ``old_log_probs``/``key``, or from the mask functions.
    """
    if recipe.token_mask == "none":
        return None, {}
    if recipe.token_mask == "s2t":
        c = recipe.s2t
        keep, tau_h = masks.s2t_mask(log_probs, entropy, advantages, response_mask, tau_p=c.tau_p,
                                     entropy_quantile=c.entropy_quantile, quantile_method=c.quantile_method,
                                     quantile_tokens=c.quantile_tokens, axis_name=axis_name,
                                     tau_h=tau_h)
        return keep, {"s2t/tau_h": tau_h}
    if recipe.token_mask == "top_entropy":
        return masks.top_entropy_mask(entropy, response_mask, ratio=recipe.top_entropy.ratio,
                                      axis_name=axis_name), {}
    if recipe.token_mask == "clip_cov":
        if old_log_probs is None or key is None:
            raise ValueError("token_mask='clip_cov' needs old_log_probs and a PRNG key")
        c = recipe.cov
        return masks.clip_cov_mask(log_probs, old_log_probs, advantages, response_mask, key,
                                   clip_ratio_low=recipe.loss.clip_ratio_low,
                                   clip_ratio_high=recipe.loss.clip_ratio_high, clip_cov_ratio=c.clip_cov_ratio,
                                   clip_cov_lb=c.clip_cov_lb, clip_cov_ub=c.clip_cov_ub), {}
    return masks.kl_cov_mask(log_probs, advantages, response_mask, kl_cov_ratio=recipe.cov.kl_cov_ratio), {}
