"""What a run config selects, beyond its values: the token mask (one key, ``actor.token_mask``; the older
``<mask>.enabled`` flags are derived from it and still read with a deprecation note), the registered extensions
it names (checked against their live registries) and the recipe's invariants (the rows of
:data:`stapo_jax.config.presets.RECIPE_PRESETS`). Used by :func:`stapo_jax.config.schema.from_dict` /
``validate``; functions take the run ``Config`` (duck-typed: this module does not import the schema).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

from stapo_jax.config.loading import set_dotted
from stapo_jax.config.presets import RECIPE_PRESETS
from stapo_jax.core.errors import ConfigError

__all__ = ["TOKEN_MASK_FLAGS", "token_mask_name", "resolve_token_mask", "check_registered_names",
           "recipe_violations"]

# the masks with an older yes/no flag: ``<mask>.enabled: true`` is ``actor.token_mask: <mask>`` (derived, deprecated)
TOKEN_MASK_FLAGS = ("s2t", "top_entropy")


def token_mask_name(cfg) -> str:
    """The run's token mask: ``actor.token_mask`` (always set by the loader); for a ``Config`` built in Python with
    ``token_mask=None``, the mask whose ``<mask>.enabled`` flag is on, else ``"none"``. Returns a str. Never
    raises. Source: verl-style one key naming the extension."""
    if cfg.actor.token_mask is not None:
        return cfg.actor.token_mask
    on = [mask for mask in TOKEN_MASK_FLAGS if getattr(cfg, mask).enabled]
    return on[0] if on else "none"


def resolve_token_mask(raw: dict[str, Any], recipe_mask: str) -> None:
    """In the raw config mapping, set ``actor.token_mask`` (the one key choosing the mask) and derive the older
    ``<mask>.enabled`` flags (:data:`TOKEN_MASK_FLAGS`) from it. ``actor.token_mask`` unset or null takes the
    flags the file still sets (one ``FutureWarning`` naming the replacement), else ``recipe_mask`` (the recipe
    row's; a recipe whose own mask's flag is set false gets ``"none"``). Takes YAML mappings.

    Raises: ConfigError naming the keys: a flag that is not a bool, two flags on, or a flag that contradicts a set
    ``actor.token_mask``. A malformed section is left to the schema build. Source: verl-style one key naming
    the extension (``actor.policy_loss.loss_mode``); this project's older flags.
    """
    actor = raw.get("actor")
    mask = actor.get("token_mask") if isinstance(actor, dict) else None
    given = {}
    for name in TOKEN_MASK_FLAGS:
        section = raw.get(name)
        if isinstance(section, dict) and "enabled" in section:
            value = section.pop("enabled")
            if not isinstance(value, bool):
                raise ConfigError(f"{name}.enabled: expected bool, got {type(value).__name__} {value!r}")
            given[name] = value
    if given:
        flags = ", ".join(f"{n}.enabled" for n in given)
        warnings.warn(f"{flags} is deprecated: the token mask is chosen by actor.token_mask (e.g. "
                      f"actor.token_mask: {mask if isinstance(mask, str) else next(iter(given))})",
                      FutureWarning, stacklevel=3)
    if mask is None:
        on = [n for n, v in given.items() if v]
        if len(on) > 1:
            raise ConfigError(f"{' and '.join(f'{n}.enabled' for n in on)} are all true; a run uses one token "
                              "mask (set actor.token_mask)")
        mask = on[0] if on else ("none" if recipe_mask in given else recipe_mask)
    elif isinstance(mask, str):
        bad = [f"{n}.enabled={str(v).lower()}" for n, v in given.items() if v != (mask == n)]
        if bad:
            raise ConfigError(f"actor.token_mask={mask} contradicts {', '.join(bad)} (set only actor.token_mask)")
    if actor is None or isinstance(actor, dict):
        set_dotted(raw, "actor.token_mask", mask)
    for name in TOKEN_MASK_FLAGS:
        if raw.get(name) is None or isinstance(raw.get(name), dict):
            set_dotted(raw, f"{name}.enabled", mask == name)


def check_registered_names(cfg, source: Optional[str] = None) -> None:
    """Check the names that select an extension against their live registries: ``actor.policy_loss``,
    ``actor.token_mask``, ``algorithm.adv_estimator`` and ``reward.kind`` (imports the registries, hence jax),
    and that the policy loss takes the token mask (``kl_cov`` needs a loss that takes its selection).

    Raises: ConfigError ``"<source>: <key>: 'x' is not a registered <kind>; did you mean 'y'? (registered: [...])"``.
    Source: verl ``get_policy_loss_fn`` / ``get_adv_estimator_fn`` (lookup by name).
    """
    from stapo_jax.algo.advantages import ADVANTAGE_ESTIMATORS  # the registries (jax): loaded on first check
    from stapo_jax.algo.masks import TOKEN_MASKS
    from stapo_jax.algo.objectives import POLICY_LOSSES
    from stapo_jax.algo.recipes import check_loss_takes_mask
    from stapo_jax.rewards.registry import REWARD_KINDS

    try:
        POLICY_LOSSES.lookup(cfg.actor.policy_loss)
        TOKEN_MASKS.lookup(token_mask_name(cfg), extra=("none",))
        ADVANTAGE_ESTIMATORS.lookup(cfg.algorithm.adv_estimator)
        REWARD_KINDS.lookup(cfg.reward.kind)
        check_loss_takes_mask(cfg.actor.policy_loss, token_mask_name(cfg))
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def recipe_violations(cfg) -> list[str]:
    """Invariants of the recipe row (:data:`~stapo_jax.config.presets.RECIPE_PRESETS`) of a run ``Config``
    (stapo_spec §4-5; conventions.md §9: STAPO/JustRL/DAPO run with KL = 0 and no entropy bonus): its token mask,
    and for a ``kl_free`` row no KL term and no entropy bonus; one message per broken one naming the keys. Lifted
    with ``algorithm.strict_recipe=false``. Problems are returned as str messages, not raised as errors."""
    recipe, a, out = cfg.algorithm.recipe, cfg.actor, []
    preset, mask = RECIPE_PRESETS[recipe], token_mask_name(cfg)
    hint = " (set algorithm.strict_recipe=false to deviate from the recipe)"
    if preset.kl_free:
        if a.use_kl_loss and a.kl_loss_coef != 0:
            out.append(f"algorithm.recipe={recipe} has no KL term: actor.use_kl_loss=true with "
                       f"actor.kl_loss_coef={a.kl_loss_coef}{hint}")
        if a.entropy_coeff != 0:
            out.append(f"algorithm.recipe={recipe} has no entropy bonus: actor.entropy_coeff={a.entropy_coeff}{hint}")
    if preset.token_mask != "none" and mask != preset.token_mask:
        out.append(f"algorithm.recipe={recipe} needs actor.token_mask={preset.token_mask} (got {mask}){hint}")
    owners = [name for name, p in RECIPE_PRESETS.items() if p.owns_mask and p.token_mask == mask]
    if owners and recipe not in owners:
        out.append(f"actor.token_mask={mask} belongs to algorithm.recipe={'/'.join(owners)} (got {recipe}){hint}")
    return out
