"""The recipe a run config describes (:func:`recipe_from_config`) and the named presets as
:class:`~stapo_jax.algo.recipes.Recipe` objects (``RECIPES``, :func:`get_recipe`).

A preset is the run config naming it (the schema defaults plus its row of
:data:`stapo_jax.config.presets.RECIPE_PRESETS`), so it lives with the schema, above the algorithm
(:mod:`stapo_jax.algo.recipes` defines the ``Recipe`` type).
"""
from __future__ import annotations

from stapo_jax.algo.recipes import Recipe
from stapo_jax.config.presets import RECIPE_PRESETS
from stapo_jax.config.schema import from_dict
from stapo_jax.config.selection import token_mask_name

__all__ = ["RECIPES", "get_recipe", "recipe_from_config"]


def recipe_from_config(cfg) -> Recipe:
    """The :class:`Recipe` a resolved run config (:class:`stapo_jax.config.schema.Config`) describes: every
    loss/mask/advantage field comes from the config (verl key names): the ``actor`` section (a
    :class:`PolicyLossConfig`) is the recipe's loss, ``actor.policy_loss`` its policy loss, ``actor.token_mask``
    (resolved by the loader: ``token_mask_name``) its mask, ``s2t`` / ``top_entropy`` / ``cov`` its mask
    settings, ``cfg.extensions`` the settings of other registered extensions (:mod:`stapo_jax.config.extensions`;
    a section the YAML leaves out is not held: the selected mask reads its defaults through
    ``algo.recipes.recipe_field``, the loss and the estimator get theirs as keywords through ``Registry.bound``:
    ``objectives.get_policy_loss_fn``, ``advantages.recipe_advantages``),
    ``algorithm`` (an ``AdvantageConfig``) its advantage,
    ``sampling`` its DAPO sampling and ``reward`` (an ``OverlongConfig``) its
    overlong shaping, used as they are (no copies); only ``data.drop_truncated`` is a single flag read by name.

    Returns a frozen :class:`Recipe`.
    Raises: ValueError (``ConfigError``) from the loss settings, or a name that is not registered (naming the key).
    Source: the config schema, configs/base.yaml.
    """
    return Recipe(
        cfg.algorithm.recipe, loss=cfg.actor, token_mask=token_mask_name(cfg), policy_loss=cfg.actor.policy_loss,
        s2t=cfg.s2t, top_entropy=cfg.top_entropy, cov=cfg.cov, advantage=cfg.algorithm, sampling=cfg.sampling,
        overlong=cfg.reward, drop_truncated=cfg.data.drop_truncated, extensions=dict(cfg.extensions))


# The presets, defined once as data: the config schema defaults plus ``stapo_jax.config.presets.RECIPE_PRESETS[name]``
# (the same table that fills a run config's unset keys), so a recipe and a config naming it agree by construction.
RECIPES: dict[str, Recipe] = {name: recipe_from_config(from_dict({"algorithm": {"recipe": name}}))
                              for name in RECIPE_PRESETS}


def get_recipe(name: str, **changes) -> Recipe:
    """The named preset, optionally with fields changed (see :meth:`Recipe.replace`). Returns a
    :class:`Recipe`.

    Raises: ValueError for an unknown name (lists the known ones) or an invalid changed value.
    Source: stapo_spec.md §4-5, §10; JustRL ``run_scaling_ssh_distill.sh``; DAPO 2503.14476.
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    recipe = RECIPES[name]
    return recipe.replace(**changes) if changes else recipe
