"""stapo_jax: STAPO RL fine-tuning of Qwen3 in JAX/Flax.

Layout (each subpackage's ``__init__`` says what it holds):

* ``stapo_jax.algo``     the pure algorithm: advantages, token masks (S2T and peers), policy losses,
  log-probs/entropies, diagnostics, the registries and the recipes;
* ``stapo_jax.train``    the RL and SFT loops: experience, batching/packing, train step, update, optimizer;
* ``stapo_jax.rollout``  the JetStream-API sampling engine and its multi-process driver;
* ``stapo_jax.rewards``  answer verifiers (math-verify strict, boxed, string match, reasoning-gym);
* ``stapo_jax.data``     prompt datasets and the tokenizer;
* ``stapo_jax.config``   the config schema, YAML loading and building objects from a config;
* ``stapo_jax.runtime``  multi-controller initialisation, collectives, checkpoints, the local launcher;
* ``stapo_jax.core``     the bottom layer: the error classes, settings coercion, the ``Registry``;
* ``stapo_jax.tools``    the CLI and its commands (eval, demo, plan, check, dump, plot).

The algorithm's public functions are re-exported here, loaded on first use so that importing a light module
(``stapo_jax.tools.dump`` runs inside PyTorch jobs) does not import JAX::

    from stapo_jax import s2t_mask, compute_policy_loss
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS_FROM = (
    "stapo_jax.algo.advantages",
    "stapo_jax.algo.chunked_logprobs",
    "stapo_jax.algo.diagnostics",
    "stapo_jax.algo.logprobs",
    "stapo_jax.algo.mask_settings",
    "stapo_jax.algo.masks",
    "stapo_jax.algo.objectives",
    "stapo_jax.algo.recipes",
    "stapo_jax.algo.s2t",
    "stapo_jax.config.recipes",
)


def _exports() -> dict[str, str]:
    """name -> module for every name in the ``__all__`` of the modules above (read without importing)."""
    import ast
    from pathlib import Path

    table: dict[str, str] = {}
    here = Path(__file__).parent
    for mod in _EXPORTS_FROM:
        tree = ast.parse((here / (mod.split(".", 1)[1].replace(".", "/") + ".py")).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                for name in ast.literal_eval(node.value):
                    table.setdefault(name, mod)
    return table


_TABLE: dict[str, str] | None = None


def __getattr__(name: str):
    global _TABLE
    if _TABLE is None:
        _TABLE = _exports()
    mod = _TABLE.get(name)
    if mod is None:
        raise AttributeError(f"module 'stapo_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)


def __dir__() -> list[str]:
    global _TABLE
    if _TABLE is None:
        _TABLE = _exports()
    return sorted(set(globals()) | set(_TABLE))
