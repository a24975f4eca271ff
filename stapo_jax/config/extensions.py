"""Settings that travel with their extension: a registered token mask (``register_token_mask(..., settings_cls=,
section=)``), reward kind (``register_reward``), policy loss (``register_policy_loss``) or advantage estimator
(``register_adv_est``) declares a frozen settings dataclass and the run-config section that holds it (the registry
alone keeps the declaration: ``Registry.declared``; verl's pattern of a loss reading its own ``policy_loss.*``
keys). The config loader reads that section for every
registered extension (:func:`split_sections`, :func:`build_settings`); a section that is a field of the schema
(``s2t``, ``top_entropy``, ``cov``) is built by the schema itself, every other one (e.g.
``reward.math_verify_strict``, or a mask registered in a new file) is held in ``Config.extensions`` by its dotted
section and reaches the :class:`~stapo_jax.algo.recipes.Recipe` (``Recipe.extensions``: a policy loss and an
estimator get theirs as keywords, ``Registry.bound``) and the scorer. :func:`check_section`: a schema section is
declared with the schema's own class, and a schema key that is not a section (``reward.kind``) cannot be one.

Importing this module does not import jax; :func:`declared_sections` imports the registries (hence jax), as
``selection.check_registered_names`` does at the end of every load.
"""
from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from stapo_jax.core.errors import ConfigError
from stapo_jax.core.settings import build_dataclass

__all__ = ["declared_sections", "check_section", "schema_has_section", "split_sections", "build_settings"]


def declared_sections(schema: type | None = None) -> dict[str, type]:
    """``{dotted section: settings dataclass}`` of every registered token mask, reward kind, policy loss and
    advantage estimator that declares settings (``register_*(..., settings_cls=S, section="x")``, kept by the
    registry: ``Registry.declared``; entries registered later, e.g. by a new module or a test, included). Imports
    the registries (jax). ``schema``: the run-config dataclass (``Config``) each section is checked against
    (:func:`check_section`); None: no check.

    Raises: ConfigError naming the extension and its section when it collides with the schema
    (:func:`check_section`), or when two extensions declare one section with different classes (naming both).
    Source: verl ``policy_loss.*`` (an extension reads its own keys); verl ``core_algos.register_*``.
    """
    from stapo_jax.algo.advantages import ADVANTAGE_ESTIMATORS  # the registries (jax): loaded on first use
    from stapo_jax.algo.masks import TOKEN_MASKS
    from stapo_jax.algo.objectives import POLICY_LOSSES
    from stapo_jax.rewards.registry import REWARD_KINDS

    out: dict[str, type] = {}
    for registry in (TOKEN_MASKS, REWARD_KINDS, POLICY_LOSSES, ADVANTAGE_ESTIMATORS):
        for name in registry:
            entry = registry.declared(name)
            if entry is None:
                continue
            if schema is not None:
                check_section(schema, f"{registry.kind} {name!r}", entry.section, entry.settings_cls)
            prev = out.setdefault(entry.section, entry.settings_cls)
            if prev is not entry.settings_cls:
                raise ConfigError(f"section {entry.section}: {registry.kind} {name!r} declares "
                                  f"{entry.settings_cls.__name__}, another extension {prev.__name__}")
    return out


def check_section(schema: type, owner: str, section: str, settings_cls: type) -> None:
    """Check an extension's declared ``section`` (dotted str) and ``settings_cls`` against the schema dataclass
    ``schema``: a section that is a dataclass field of the schema (``cov``) must declare exactly that field's class
    (the schema builds it); a section that is, or sits below, a schema key that is not a section (``reward.kind``,
    ``actor.policy_loss``, ``data.gym.config``) is refused (its YAML value is the schema's). Any other section is
    the extension's own (``Config.extensions``). ``owner`` names the extension in messages (``"token mask 'x'"``).

    Raises: ConfigError naming ``owner``, the section and the schema's class or key. Never returns a value.
    Source: this module's rule (a section is built by the schema or held in ``Config.extensions``, never both).
    """
    place, found = _place(schema, section)
    if place == "own":
        return
    if place == "key":
        raise ConfigError(f"{owner} declares settings section {section!r}, but {found} is a key of the run config, "
                          f"not a section (choose a section of its own)")
    tp = found
    if tp is not settings_cls:
        raise ConfigError(f"{owner} declares settings section {section!r} with {settings_cls.__name__}, but the run "
                          f"config's {section} section is {tp.__name__} (declare {tp.__name__} or a section of its "
                          f"own)")


def schema_has_section(schema: type, section: str) -> bool:
    """Whether the dotted ``section`` is a (nested) dataclass field of the schema dataclass ``schema``
    (``s2t`` of ``Config``). Takes a dataclass type and a str. Never raises. Source: the schema annotations."""
    return _place(schema, section)[0] == "section"


def _place(schema: type, section: str) -> tuple[str, Any]:
    """Where the dotted ``section`` falls in the schema dataclass: ``("section", its dataclass)``, ``("key",
    the dotted schema key that is a value, at or above it)`` or ``("own", None)`` (no schema field: an
    extension's own section). The one walk of the schema annotations both public checks use."""
    tp: Any = schema
    parts = section.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(tp):
            return "key", ".".join(parts[:i])
        hints = get_type_hints(tp)
        if part not in hints:
            return "own", None
        tp = hints[part]
    return ("section", tp) if dataclasses.is_dataclass(tp) else ("key", section)


def split_sections(raw: dict, sections: dict[str, type], schema: type) -> dict[str, Any]:
    """Remove from the nested mapping ``raw`` (in place) the declared ``sections`` the ``schema`` has no field for,
    and return them ``{dotted section: raw value}`` (absent ones are not returned). Takes YAML mappings;
    ``sections`` as :func:`declared_sections` of the same ``schema`` returns them (checked: none is a schema key).

    Raises: ConfigError ``extensions`` when ``raw`` sets that reserved key (it is filled by the loader).
    Source: this module's rule (an extension's section is where its YAML sits).
    """
    if "extensions" in raw:
        raise ConfigError("unknown config key 'extensions' (an extension's settings go in its own section, e.g. "
                          "reward.math_verify_strict)")
    out = {}
    for section in sections:
        if schema_has_section(schema, section):
            continue
        *parents, leaf = section.split(".")
        node = raw
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            out[section] = node.pop(leaf)
    return out


def build_settings(found: dict[str, Any], sections: dict[str, type]) -> dict[str, Any]:
    """``{dotted section: settings instance}`` for each section in ``found`` (:func:`split_sections`: the declared
    sections the YAML sets and the schema has no field for); a section the YAML leaves out is not held (its users
    take the class defaults: :func:`stapo_jax.core.registry.settings_for`), so a config without one equals ``Config()``.

    Raises: ConfigError naming ``<section>.<key>`` (unknown key, wrong type, or the class's own range check).
    Source: :func:`stapo_jax.config.loading.build_dataclass` (the schema's typed build).
    """
    return {section: build_dataclass(sections[section], value, section + ".") for section, value in found.items()}
