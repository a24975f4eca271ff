"""What a run config selects, beyond its values: the token mask (``actor.token_mask`` or the older
``<mask>.enabled`` flags), the registered extensions it names (checked against their live registries) and the
recipe's invariants. Used by :func:`stapo_jax.config.schema.from_dict` / ``validate``; functions take the run
``Config`` (duck-typed: this module does not import the schema).
"""
from __future__ import annotations

from typing import Any, Optional

from stapo_jax.config.loading import has_dotted, set_dotted
from stapo_jax.core.errors import ConfigError

__all__ = ["TOKEN_MASK_FLAGS", "token_mask_name", "apply_token_mask_key", "token_mask_violations",
           "check_registered_names", "recipe_violations"]

# the masks the older yes/no flags name: ``<section>.enabled: true`` is ``actor.token_mask: <mask>``
TOKEN_MASK_FLAGS = {"s2t": "s2t.enabled", "top_entropy": "top_entropy.enabled"}


def token_mask_name(cfg) -> str:
    """The run's token mask: ``actor.token_mask`` when set, else the mask whose ``<section>.enabled`` flag is on
    (:data:`TOKEN_MASK_FLAGS`), else ``"none"``. Returns a str. Never raises (the flags and the
    key are checked for agreement by :func:`validate`). Source: verl-style one key naming the extension."""
    if cfg.actor.token_mask is not None:
        return cfg.actor.token_mask
    on = [mask for mask, flag in TOKEN_MASK_FLAGS.items() if getattr(cfg, flag.split(".")[0]).enabled]
    return on[0] if on else "none"


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


def apply_token_mask_key(raw: dict[str, Any]) -> None:
    """In the raw config mapping, let ``actor.token_mask: <mask>`` set the older flags it implies
    (``<mask>.enabled``, :data:`TOKEN_MASK_FLAGS`) that the file and overrides leave unset, before the recipe
    defaults fill the rest. Takes YAML mappings. Never raises (a malformed section is reported by the
    schema build). Source: verl-style one key naming the extension."""
    mask = raw.get("actor", {}).get("token_mask") if isinstance(raw.get("actor"), dict) else None
    if isinstance(mask, str):
        for name, flag in TOKEN_MASK_FLAGS.items():
            if isinstance(raw.get(flag.split(".")[0], {}), dict) and not has_dotted(raw, flag):
                set_dotted(raw, flag, mask == name)


def token_mask_violations(cfg) -> list[str]:
    """One message per ``<mask>.enabled`` flag that contradicts a set ``actor.token_mask``, as str. Never
    raises (returns the messages). Source: this project's config rule (one token mask per run)."""
    mask, out = cfg.actor.token_mask, []
    if mask is not None:
        for name, flag in TOKEN_MASK_FLAGS.items():
            on = getattr(cfg, flag.split(".")[0]).enabled
            if on != (mask == name):
                out.append(f"actor.token_mask={mask} contradicts {flag}={str(on).lower()} (set one of them)")
    return out


def recipe_violations(cfg) -> list[str]:
    """Invariants of each recipe of a run ``Config`` (stapo_spec §4-5; conventions.md §9: STAPO/JustRL/DAPO run
    with KL = 0 and no entropy bonus), one message per broken one naming the keys. Lifted with
    ``algorithm.strict_recipe=false``. Problems are returned as str messages, not raised as errors."""
    recipe, a, out = cfg.algorithm.recipe, cfg.actor, []
    hint = " (set algorithm.strict_recipe=false to deviate from the recipe)"
    if recipe in ("stapo", "justrl", "dapo"):
        if a.use_kl_loss and a.kl_loss_coef != 0:
            out.append(f"algorithm.recipe={recipe} has no KL term: actor.use_kl_loss=true with "
                       f"actor.kl_loss_coef={a.kl_loss_coef}{hint}")
        if a.entropy_coeff != 0:
            out.append(f"algorithm.recipe={recipe} has no entropy bonus: actor.entropy_coeff={a.entropy_coeff}{hint}")
    if recipe == "stapo" and not cfg.s2t.enabled:
        out.append(f"algorithm.recipe=stapo needs s2t.enabled=true{hint}")
    if recipe == "entropy20" and not cfg.top_entropy.enabled:
        out.append(f"algorithm.recipe=entropy20 needs top_entropy.enabled=true{hint}")
    if recipe != "stapo" and cfg.s2t.enabled:
        out.append(f"s2t.enabled=true belongs to algorithm.recipe=stapo (got {recipe}){hint}")
    return out
