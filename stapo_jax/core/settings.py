"""Settings dataclasses' validation, shared by every layer: the named-choice check, and the typed building / type
checking of a settings dataclass from plain values (type coercion, unknown keys with did-you-mean suggestions),
each failure a :class:`~stapo_jax.core.errors.ConfigError`. In the core layer: it imports only
:mod:`stapo_jax.core.errors`, so the algorithm's settings (``stapo_jax.algo.*_settings``) and the run schema
(:mod:`stapo_jax.config.schema`) both build on it; :mod:`stapo_jax.config.loading` adds YAML and dotted overrides
on top.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from stapo_jax.core.errors import ConfigError

__all__ = ["check_one_of", "check_field_types", "coerce", "type_name", "build_dataclass",
           "unknown_keys", "unknown_key_message", "dataclass_keys"]


def dataclass_keys(cls: type, prefix: str = "") -> list[str]:
    """All dotted leaf keys of the settings dataclass ``cls`` (dict-valued fields are leaves), each after
    ``prefix``. Returns str keys. Never raises. Source: the schema dataclasses (verl-style dotted
    keys)."""
    out = []
    for name, tp in get_type_hints(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            out.extend(dataclass_keys(tp, key + "."))
        else:
            out.append(key)
    return out


def build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    """Instantiate schema dataclass ``cls`` from ``raw`` with type checks; unknown keys raise.
    Takes YAML scalars, lists, mappings. Raises: ConfigError naming the key. Source: the schema (verl-
    style dotted keys)."""
    where = prefix.rstrip(".") or "<top level>"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {type(raw).__name__} {raw!r}")
    hints = get_type_hints(cls)
    for key in raw:
        if key not in hints:
            raise ConfigError(unknown_key_message(f"{prefix}{key}", list(hints), prefix))
    kwargs = {name: coerce(raw[name], hints[name], f"{prefix}{name}") for name in hints if name in raw}
    return cls(**kwargs)


def unknown_keys(cls: type, raw: Any, prefix: str, root: type | None = None) -> list[str]:
    """One message (with its did-you-mean) per unknown key anywhere under ``raw``, in file order, so that a
    config with several typos is fixed in one round; sections that are not mappings are left to ``_build``.
    ``root`` (default ``cls``): the whole schema, searched for the same key in another section.
    Returns str messages. Never raises. Source: the schema (verl-style dotted keys)."""
    if not isinstance(raw, dict):
        return []
    root = cls if root is None else root
    hints = get_type_hints(cls)
    out = []
    for key, value in raw.items():
        if key not in hints:
            out.append(unknown_key_message(f"{prefix}{key}", list(hints), prefix, root))
        elif dataclasses.is_dataclass(hints[key]):
            out.extend(unknown_keys(hints[key], value, f"{prefix}{key}.", root))
    return out


_MISMATCH = object()  # a coercion helper's "value does not have this type" (the caller raises the message)


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp`` and convert losslessly (int -> float, list -> tuple, a
    numeric string such as YAML 1.1's ``1e-6`` -> float).
    Raises: ConfigError naming ``key`` and the expected type. Source: YAML 1.1 (``1e-6`` is read as a str)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, key + ".")
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, args, key)
    if origin is Literal:
        return _coerce_literal(value, args, key)
    if tp in (bool, int, float, str):
        out = _coerce_scalar(value, tp, key)
    elif origin in (list, tuple, dict):
        out = _coerce_container(value, origin, args, key)
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"unsupported annotation {tp!r} for {key}")
    if out is _MISMATCH:
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")
    return out


def _coerce_union(value: Any, tp: Any, args: tuple, key: str) -> Any:
    """``Optional[X]`` / ``X | Y``: null where allowed, else the first member type that takes ``value``."""
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {type_name(tp)})")
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, key)
        except ConfigError as e:
            if len(args) == 2 and type(None) in args and not str(e).startswith(f"{key}: expected "):
                raise  # Optional[X] and X's own complaint (e.g. "not a finite number"): keep it
            continue
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


def _coerce_literal(value: Any, args: tuple, key: str) -> Any:
    """A named choice: ``value`` must equal one of ``args`` with the same type (YAML's bare off/on bools mapped
    back to the words); else a did-you-mean error."""
    if isinstance(value, bool) and ("off" if not value else "on") in args:
        value = "off" if not value else "on"  # YAML 1.1 reads a bare off/on as a bool
    for choice in args:
        if value == choice and type(value) is type(choice):
            return value
    close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if isinstance(value, bool):  # e.g. actor.sampler_is=on: YAML 1.1 turned the word into a bool
        hint = "; YAML reads a bare on/off/yes/no/true/false as a boolean: write one of the names above, quoted"
    raise ConfigError(f"{key}: {value!r} is not one of {list(args)}{hint}")


def _coerce_scalar(value: Any, tp: type, key: str) -> Any:
    """bool / int / float / str; ``_MISMATCH`` when ``value`` is not one (a non-finite float raises)."""
    if tp is bool:
        return value if isinstance(value, bool) else _MISMATCH
    if tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # also numpy ints
            return int(value)
        return _MISMATCH
    if tp is str:
        return value if isinstance(value, str) else _MISMATCH
    number = None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # also numpy floats
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        return _MISMATCH
    if not math.isfinite(number):  # nan/inf would train silently into a NaN model
        raise ConfigError(f"{key}: {value!r} is not a finite number")
    return number


def _coerce_container(value: Any, origin: type, args: tuple, key: str) -> Any:
    """``list[X]``, ``tuple[X, ...]`` / ``tuple[X, Y]`` and ``dict[str, X]``, each item coerced under
    ``key[i]`` / ``key.k``; ``_MISMATCH`` when ``value`` is not such a container."""
    if origin is list and isinstance(value, (list, tuple)):
        return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple and isinstance(value, (list, tuple)):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) == len(args):
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict and isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ConfigError(f"{key}: keys must be strings, got {k!r}")
            out[k] = coerce(v, args[1], f"{key}.{k}")
        return out
    return _MISMATCH


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    return get_type_hints(cls)


def check_one_of(key: str, value, allowed) -> None:
    """Raise ConfigError ``"<key>: <value!r> is not one of [...]"`` unless ``value`` is in ``allowed`` (any
    container of the allowed values; listed in its order). The one check of a named choice for the config
    dataclasses and the algorithm functions' string arguments. Raises: ConfigError (a ValueError) naming
    ``key``. Source: this project's config errors (name the key, say what is allowed)."""
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {list(allowed)}")


def check_field_types(obj: Any, section: str) -> None:
    """Type-check (and losslessly convert, as :func:`coerce`: int -> float, list -> tuple) every field of the
    frozen settings dataclass ``obj`` in place, so that a settings object built directly in Python
    (``PolicyLossConfig(clip_ratio_low="abc")``) fails as the YAML path does, not with a ``TypeError`` deep in a
    range check. Nested dataclass fields that already hold an instance are left to their own check, and so are
    names (``Literal`` fields): the section checks those itself, against a registry where one exists (an
    ``adv_estimator`` registered by the user is valid in Python).
    Raises: ConfigError naming ``<section>.<field>`` (wrong type, null, non-finite float).
    Source: the schema annotations (the same rules as a YAML value)."""
    for name, tp in _hints(type(obj)).items():
        value = getattr(obj, name)
        if (dataclasses.is_dataclass(tp) and isinstance(value, tp)) or get_origin(tp) is Literal:
            continue
        object.__setattr__(obj, name, coerce(value, tp, f"{section}.{name}"))


def type_name(tp: Any) -> str:
    """A human name for a schema annotation (``"int or null"``, ``"one of 'a', 'b'"``) for error messages.
    Source: the schema annotations (``typing``)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {type_name(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} values" if Ellipsis not in args else f"a list of {type_name(args[0])}"
    if origin is dict:
        return f"a mapping of str to {type_name(args[1])}"
    return getattr(tp, "__name__", str(tp))


def unknown_key_message(key: str, siblings: list[str], prefix: str, root: type | None = None) -> str:
    """The ``ConfigError`` text for an unknown ``key``: a close sibling, or the same leaf in another section of
    the schema ``root`` (None: siblings only), or else the valid keys here. Takes str keys. Source:
    the schema (verl-style dotted keys)."""
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        suggestion = f"{prefix}{close[0]}"
    else:  # maybe the key lives in another section (e.g. actor.tau_p -> s2t.tau_p)
        all_keys = dataclass_keys(root) if root is not None else []
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in all_keys}
        close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        suggestion = by_leaf[close[0]] if close else None
        if suggestion is None:
            close = difflib.get_close_matches(key, all_keys, n=1, cutoff=0.5)
            suggestion = close[0] if close else None
    msg = f"unknown config key {key!r}"
    if suggestion:
        msg += f"; did you mean {suggestion!r}?"
    else:
        msg += f"; valid keys here: {sorted(siblings)}"
    return msg
