"""Typed building of configuration dataclasses from plain YAML mappings: type coercion, unknown keys with
did-you-mean suggestions, dotted-key helpers. Schema-agnostic: :mod:`stapo_jax.config.schema` holds the schema.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import types
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

import yaml

__all__ = ["ConfigError", "build_dataclass", "unknown_keys", "coerce", "type_name", "unknown_key_message",
           "has_dotted", "set_dotted", "plain_copy", "valid_keys", "parse_override", "safe_load_unique",
           "check_field_types", "check_one_of"]


class ConfigError(ValueError):
    """A config key is unknown, a value has the wrong type or range, or two keys contradict each other.

    The message always names the dotted key(s) involved.
    """


def valid_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """All dotted leaf keys of a schema dataclass (dict-valued fields are leaves); None: the run ``Config``.
    Takes no arrays; returns str keys. Never raises. Source: the schema dataclasses (verl-style dotted keys)."""
    if cls is None:
        from stapo_jax.config.schema import Config  # the schema (imported lazily: config imports this module)

        cls = Config
    out = []
    for name, tp in get_type_hints(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            out.extend(valid_keys(tp, key + "."))
        else:
            out.append(key)
    return out



def build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    """Instantiate schema dataclass ``cls`` from ``raw`` with type checks; unknown keys raise.
    Takes no arrays (YAML scalars, lists, mappings). Raises: ConfigError naming the key. Source: the schema (verl-
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


def unknown_keys(cls: type, raw: Any, prefix: str) -> list[str]:
    """One message (with its did-you-mean) per unknown key anywhere under ``raw``, in file order, so that a
    config with several typos is fixed in one round; sections that are not mappings are left to ``_build``.
    Takes no arrays; returns str messages. Never raises. Source: the schema (verl-style dotted keys)."""
    if not isinstance(raw, dict):
        return []
    hints = get_type_hints(cls)
    out = []
    for key, value in raw.items():
        if key not in hints:
            out.append(unknown_key_message(f"{prefix}{key}", list(hints), prefix))
        elif dataclasses.is_dataclass(hints[key]):
            out.extend(unknown_keys(hints[key], value, f"{prefix}{key}."))
    return out


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
    if origin is Literal:
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
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # also numpy ints
            return int(value)
    elif tp is float:
        number = None
        if isinstance(value, numbers.Real) and not isinstance(value, bool):  # also numpy floats
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # nan/inf would train silently into a NaN model
                raise ConfigError(f"{key}: {value!r} is not a finite number")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)):
            return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is tuple:
        if isinstance(value, (list, tuple)):
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
            if len(value) == len(args):
                return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict:
        if isinstance(value, dict):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(f"{key}: keys must be strings, got {k!r}")
                out[k] = coerce(v, args[1], f"{key}.{k}")
            return out
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"unsupported annotation {tp!r} for {key}")
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")


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
    Takes no arrays. Raises: ConfigError naming ``<section>.<field>`` (wrong type, null, non-finite float).
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


def unknown_key_message(key: str, siblings: list[str], prefix: str) -> str:
    """The ``ConfigError`` text for an unknown ``key``: a close sibling, or the same leaf in another section,
    or else the valid keys here. Takes no arrays (str keys). Source: the schema (verl-style dotted keys)."""
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        suggestion = f"{prefix}{close[0]}"
    else:  # maybe the key lives in another section (e.g. actor.tau_p -> s2t.tau_p)
        all_keys = valid_keys()
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


def has_dotted(raw: Mapping[str, Any], key: str) -> bool:
    """Whether the nested mapping ``raw`` has the dotted ``key`` (``"actor.clip_ratio_low"``). Never raises.
    Takes no arrays (str keys). Source: verl / Hydra-style dotted overrides."""
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted ``key`` in the nested dict ``raw``, creating sections.

    Raises: ConfigError if a prefix of ``key`` is a value, not a section.
    Takes no arrays (str keys, YAML values). Source: verl / Hydra-style dotted overrides."""
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def plain_copy(x: Any) -> Any:
    """A copy made of plain dicts and lists (YAML-safe; tuples become lists).
    Takes no arrays. Never raises. Source: ``yaml.safe_dump`` accepts only plain types."""
    if isinstance(x, Mapping):
        return {k: plain_copy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_copy(v) for v in x]
    return x


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that rejects a mapping key given twice (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, str) and key in seen:
                raise ConfigError(f"config key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                  "YAML would keep only the last one")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def safe_load_unique(text: str) -> Any:
    """``yaml.safe_load(text)``, except that a key repeated in one mapping raises.
    Takes no arrays (YAML text in, plain YAML values out). Raises: ConfigError naming the repeated key and its
    line; yaml.YAMLError for invalid YAML. Source: YAML 1.2 §3.2.1.1 (mapping keys are unique)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(item: str) -> tuple[str, Any]:
    """Split ``"a.b.c=value"`` into ``("a.b.c", yaml.safe_load("value"))``.

    Raises:
      ConfigError: no ``=``, an empty key, or a value that is not valid YAML.
    Takes no arrays (str in, str key and YAML value out). Source: verl / Hydra-style ``key=value`` overrides.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key.sub=value")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {key}: value {text!r} is not valid YAML: {e}") from e
    return key, value
