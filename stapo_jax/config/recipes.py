"""The named presets as :class:`~stapo_jax.algo.recipes.Recipe` objects: ``RECIPES`` and :func:`get_recipe`.

A preset is the run config naming it (the schema defaults plus :data:`stapo_jax.config.schema.RECIPE_DEFAULTS`),
so it lives with the schema, above the algorithm (:mod:`stapo_jax.algo.recipes` defines the ``Recipe`` type and
:func:`~stapo_jax.algo.recipes.recipe_from_config`).
"""
from __future__ import annotations

from stapo_jax.algo.recipes import Recipe, recipe_from_config
from stapo_jax.config.schema import RECIPES as CONFIG_RECIPES
from stapo_jax.config.schema import from_dict

__all__ = ["RECIPES", "get_recipe"]


# The presets, defined once as data: the config schema defaults plus ``stapo_jax.config.schema.RECIPE_DEFAULTS[name]``
# (the same table that fills a run config's unset keys), so a recipe and a config naming it agree by construction.
RECIPES: dict[str, Recipe] = {name: recipe_from_config(from_dict({"algorithm": {"recipe": name}}))
                              for name in CONFIG_RECIPES}


def get_recipe(name: str, **changes) -> Recipe:
    """The named preset, optionally with fields changed (see :meth:`Recipe.replace`). No arrays: returns a
    :class:`Recipe`.

    Raises: ValueError for an unknown name (lists the known ones) or an invalid changed value.
    Source: stapo_spec.md §4-5, §10; JustRL ``run_scaling_ssh_distill.sh``; DAPO 2503.14476.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    recipe = RECIPES[name]
    return recipe.replace(**changes) if changes else recipe
