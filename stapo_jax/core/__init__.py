"""The bottom layer, under every other package of ``stapo_jax`` and under ``models``: the project's error classes
(:mod:`~stapo_jax.core.errors`), the typed building and checking of settings dataclasses
(:mod:`~stapo_jax.core.settings`) and the registries by name (:mod:`~stapo_jax.core.registry`). It imports only the
standard library (no JAX, no YAML), so a config loads and a light tool runs without them.
"""
