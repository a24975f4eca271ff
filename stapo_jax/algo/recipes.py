"""Named presets: ``grpo``, ``dapo``, ``entropy20``, ``justrl``, ``stapo`` (stapo_spec.md §4, §5, §10).

A recipe is a frozen :class:`Recipe`: the loss settings (:class:`~stapo_jax.algo.objectives.PolicyLossConfig`,
verl key names), the token mask and its settings (:class:`~stapo_jax.algo.masks.S2TConfig`,
:class:`~stapo_jax.algo.masks.TopEntropyConfig`), the advantage estimator, and DAPO's sampling/reward hooks.
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
GRPO advantages (ddof 1, epsilon 1e-6). The presets as objects (``RECIPES``, ``get_recipe``) are built from the
config schema in :mod:`stapo_jax.config.recipes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from stapo_jax.algo import masks
from stapo_jax.algo.advantages import ADVANTAGE_ESTIMATORS
from stapo_jax.algo.masks import CovConfig, S2TConfig, TopEntropyConfig
from stapo_jax.algo.objectives import KL_COV_POLICY_LOSSES, POLICY_LOSSES, PolicyLossConfig
from stapo_jax.algo.recipe_settings import AdvantageConfig, OverlongConfig, SamplingConfig
from stapo_jax.core.errors import ConfigError
from stapo_jax.core.registry import settings_for

__all__ = ["Recipe", "compute_token_mask", "recipe_field", "selected_settings", "check_loss_takes_mask"]


@dataclass(frozen=True)
class Recipe:
    """One RL method's settings.

    name: recipe name. loss: surrogate settings (verl names). token_mask: ``none`` or a registered mask
    (``masks.TOKEN_MASKS``, including ones registered later). policy_loss: a registered policy loss
    (``objectives.POLICY_LOSSES``, verl's ``policy_loss.loss_mode``; ``vanilla`` serves every preset).
    s2t / top_entropy / cov: settings of the corresponding masks. advantage: the estimator and its GRPO
    normalisation (:class:`~stapo_jax.algo.recipe_settings.AdvantageConfig`). sampling: DAPO's drop-constant-groups
    resampling (``SamplingConfig``). overlong: DAPO overlong reward shaping (``OverlongConfig``, 0 = off).
    drop_truncated: give truncated responses an all-zero response mask. extensions: ``{section: settings}`` of
    registered extensions whose section is not a field here (a mask registered in a new file with its own
    ``settings_cls``; the run config's ``Config.extensions``); an absent section means the declared class's
    defaults (:func:`selected_settings`, ``Registry.bound``). A run config's sections are these
    settings themselves (``actor`` = loss, ``algorithm`` = advantage, ``reward`` = overlong, ...), not copies.
    """

    name: str
    loss: PolicyLossConfig
    token_mask: str = "none"
    policy_loss: str = "vanilla"
    s2t: S2TConfig = field(default_factory=S2TConfig)
    top_entropy: TopEntropyConfig = field(default_factory=TopEntropyConfig)
    cov: CovConfig = field(default_factory=CovConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    drop_truncated: bool = False
    extensions: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        # the live registries (entries registered later included); ConfigError naming the key, with did-you-mean
        masks.TOKEN_MASKS.lookup(self.token_mask, extra=("none",))
        POLICY_LOSSES.lookup(self.policy_loss)
        ADVANTAGE_ESTIMATORS.lookup(self.advantage.adv_estimator)
        check_loss_takes_mask(self.policy_loss, self.token_mask)

    @property
    def renormalize(self) -> bool:
        """Whether masked tokens leave the denominator (the mask's registered rule: False only for S2T with
        renormalize=false and Clip-Cov)."""
        if self.token_mask == "none":
            return True
        rule = masks.get_token_mask(self.token_mask).renormalize
        return recipe_field(self, rule) if isinstance(rule, str) else rule

    @property
    def mask_scope(self) -> str:
        """``minibatch`` or ``microbatch``: the population scope of the mask's threshold (``microbatch`` for masks
        without a scope setting and for ``none``)."""
        spec = None if self.token_mask == "none" else masks.get_token_mask(self.token_mask)
        return "microbatch" if spec is None or spec.scope is None else recipe_field(self, spec.scope)

    def replace(self, **changes) -> "Recipe":
        """``dataclasses.replace``; nested sections accept dicts, e.g. ``replace(loss={"clip_ratio_c": None})``."""
        for section in ("loss", "s2t", "top_entropy", "cov", "advantage", "sampling", "overlong"):
            if isinstance(changes.get(section), dict):
                changes[section] = dataclasses.replace(getattr(self, section), **changes[section])
        return dataclasses.replace(self, **changes)


def mask_selects_tokens(token_mask: str) -> bool:
    """Whether the token mask ``token_mask`` is a *selection* for a penalty (``kl_cov``: registry field
    ``selects``) rather than a keep mask; ``"none"`` selects nothing. Takes a str name, returns a bool.
    Raises: ValueError for an unknown mask name. Source: verl ``compute_policy_loss_kl_cov`` (a selection)."""
    return token_mask != "none" and masks.get_token_mask(token_mask).selects


def check_loss_takes_mask(policy_loss: str, token_mask: str) -> None:
    """Reject a selecting token mask (``kl_cov``: registry field ``selects``) with a policy loss that takes no
    ``kl_cov_selection`` (:data:`~stapo_jax.algo.objectives.KL_COV_POLICY_LOSSES`), e.g. ``gspo``: at config load,
    not at the first update. Both names must be registered (looked up first). Takes str names.
    Raises: ConfigError naming ``actor.policy_loss`` and ``actor.token_mask``. Source: verl's KL-Cov, a
    ``loss_mode`` of its own (``compute_policy_loss_kl_cov``) that no other loss combines with."""
    if not mask_selects_tokens(token_mask):
        return
    if policy_loss not in KL_COV_POLICY_LOSSES:
        raise ConfigError(f"actor.policy_loss={policy_loss} cannot be combined with actor.token_mask={token_mask}: "
                          f"the mask selects tokens for the KL-Cov penalty, which only the policy losses "
                          f"{sorted(KL_COV_POLICY_LOSSES)} take (set actor.policy_loss=vanilla or another "
                          f"actor.token_mask)")


def selected_settings(recipe: Recipe, section: str) -> Any:
    """The settings instance at the dotted ``section`` that is not a recipe field: ``recipe.extensions[section]``,
    else the ``settings_cls()`` defaults of the extension the recipe selects (its token mask, policy loss or
    advantage estimator) that declares that section (``Registry.declared``; :func:`settings_for`), else None.
    So a recipe built in Python (``get_recipe("justrl", token_mask="my_mask")``, ``extensions={}``) reads its
    mask's defaults, as ``Registry.bound`` gives a loss or an estimator theirs. Never raises (but as the class's
    own check of its defaults). Source: :mod:`stapo_jax.core.registry` (an absent section means its defaults)."""
    if section in recipe.extensions:
        return recipe.extensions[section]
    selected = ((masks.TOKEN_MASKS, recipe.token_mask), (POLICY_LOSSES, recipe.policy_loss),
                (ADVANTAGE_ESTIMATORS, recipe.advantage.adv_estimator))
    for registry, name in selected:
        declared = registry.declared(name)
        if declared is not None and declared.section == section:
            return settings_for(recipe.extensions, declared)
    return None


def recipe_field(recipe: Recipe, dotted: str):
    """``recipe_field(r, "s2t.tau_p") == r.s2t.tau_p`` (the registries name recipe settings this way); a section
    that is not a recipe field is looked up in ``recipe.extensions`` (``"my_mask.window"``), and when absent there
    is the declared settings class's default of the selected extension owning it (:func:`selected_settings`).

    Returns the setting's Python value. Raises: ValueError if ``dotted`` is not ``section.name``,
    AttributeError for a section that is neither a recipe field, in ``recipe.extensions``, nor declared by the
    recipe's mask / policy loss / estimator, or for an unknown field. Source: the ``settings=`` names of
    :func:`stapo_jax.algo.masks.register_token_mask` (config key spelling, verl-style dotted keys)."""
    section, name = dotted.rsplit(".", 1)
    if "." not in section and hasattr(recipe, section):
        return getattr(getattr(recipe, section), name)
    settings = selected_settings(recipe, section)
    if settings is None:
        raise AttributeError(f"recipe {recipe.name!r} has no settings section {section!r} (fields and "
                             f"extensions: {sorted(recipe.extensions)})")
    return getattr(settings, name)


def compute_token_mask(
    recipe: Recipe,
    *,
    response_mask,
    log_probs=None,
    entropy=None,
    advantages=None,
    old_log_probs=None,
    key=None,
    axis_name=None,
    tau_h=None,
):
    """The recipe's token mask on this population (all inputs stop-gradient), by the mask registry.

    Args:
      recipe: a :class:`Recipe`. response_mask: ``[B, T]``. The statistics the mask declares it needs
        (``masks.get_token_mask(name).needs``): log_probs / entropy / old_log_probs ``[B, T]`` float, advantages
        ``[B]`` or ``[B, T]``, key a PRNG key; the others may be omitted. axis_name: mesh axes to gather the
        threshold population over (inside ``shard_map``; masks with a scope). tau_h: S2T only, a given entropy
        threshold instead of the population quantile (see :func:`stapo_jax.algo.masks.s2t_mask`).

    Returns:
      ``(keep, stats)``: ``keep`` ``[B, T]`` bool or None (no mask; for a *selecting* mask such as ``kl_cov`` it
      is the selection, passed to the objective as ``kl_cov_selection``); ``stats``: the mask's threshold under
      its registry entry's ``metric_name`` (``s2t/tau_h`` for S2T, else ``<mask>/threshold``; a scalar, NaN for an
      empty population).

    Raises: ValueError naming a statistic the mask needs but did not get, or from the mask function.
    """
    if recipe.token_mask == "none":
        return None, {}
    spec = masks.get_token_mask(recipe.token_mask)
    given = dict(log_probs=log_probs, entropy=entropy, advantages=advantages, old_log_probs=old_log_probs, key=key)
    missing = [n for n in spec.needs if given[n] is None]
    if missing:
        raise ValueError(f"token_mask={spec.name!r} needs {missing} (it reads {list(spec.needs)})")
    kwargs = {n: given[n] for n in spec.needs}
    kwargs.update({d.rsplit(".", 1)[1]: recipe_field(recipe, d) for d in spec.settings})
    if spec.scope is not None:
        kwargs["axis_name"] = axis_name
    if tau_h is not None:
        kwargs["tau_h"] = tau_h
    keep, threshold = spec.fn(response_mask=response_mask, **kwargs)
    return keep, {spec.metric_name: threshold}
