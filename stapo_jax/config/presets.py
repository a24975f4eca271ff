"""The named recipes as data rows (stapo_spec.md §5 table): the one definition of the recipe names
(``algorithm.recipe``), each row's token mask, its invariant and the other keys it sets. The schema
(:mod:`stapo_jax.config.schema`: the ``algorithm.recipe`` choices, the defaults of unset keys), the checks
(:func:`stapo_jax.config.selection.recipe_violations`) and the :class:`~stapo_jax.algo.recipes.Recipe` objects
(:mod:`stapo_jax.config.recipes`) all read :data:`RECIPE_PRESETS`. jax-free.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

__all__ = ["RecipePreset", "RECIPE_PRESETS", "RECIPE_NAMES", "RecipeName"]


@dataclass(frozen=True)
class RecipePreset:
    """One named recipe. token_mask: the mask the recipe uses (``actor.token_mask`` when the file leaves it
    unset; required under ``algorithm.strict_recipe``). kl_free: the recipe has no KL term and no entropy bonus
    (checked under ``algorithm.strict_recipe``; conventions.md §9). owns_mask: no other recipe may use its token
    mask under ``algorithm.strict_recipe`` (S2T is STAPO). defaults: ``{dotted key: value}`` applied to the
    keys the file and the overrides leave unset (over the schema defaults)."""

    token_mask: str = "none"
    kl_free: bool = True
    owns_mask: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)


# stapo_spec §5 table; all use dual clip 10, clip-higher 0.28 and GRPO advantages unless a row says otherwise
RECIPE_PRESETS: dict[str, RecipePreset] = {
    "grpo": RecipePreset(kl_free=False, defaults={"actor.clip_ratio_high": 0.2}),
    "dapo": RecipePreset(defaults={"sampling.dynamic": True, "reward.overlong_buffer_len": 4096,
                                   "reward.overlong_penalty": 1.0}),
    "entropy20": RecipePreset(token_mask="top_entropy", kl_free=False),
    "justrl": RecipePreset(),
    "stapo": RecipePreset(token_mask="s2t", owns_mask=True),
}
RECIPE_NAMES: tuple[str, ...] = tuple(RECIPE_PRESETS)
RecipeName = Literal[RECIPE_NAMES]  # the schema's ``algorithm.recipe`` choices
