"""Registries by name (verl ``core_algos``' ``register_adv_est`` / ``register_policy_loss`` pattern): the advantage
estimators, policy losses, token masks, mask strategies and reward kinds.

A :class:`Registry` is a dict filled by its ``register`` decorator in the module that defines each entry. It names
those modules itself (``homes``: the modules holding entries; ``packages``: folders whose every module may hold
entries, so that adding an entry is one new file there) and imports them before any lookup, so a lookup never
depends on what its caller happened to import. A name it does not know is a :class:`ConfigError` naming the
config key, with the closest registered name (``difflib``).

An entry may declare settings of its own (``register(..., settings_cls=S, section="x.y")``: a frozen dataclass and
the dotted run-config section that holds it). The registry keeps that declaration (:meth:`Registry.declared`);
``stapo_jax.config.extensions`` reads the section for every registry's declarations, and :meth:`Registry.bound`
gives a function entry with its settings bound as keywords (:func:`settings_for`, :func:`settings_keywords`).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from stapo_jax.core.errors import ConfigError

__all__ = ["Registry", "DeclaredSettings", "did_you_mean", "settings_for", "settings_keywords"]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known`` to ``name`` (``difflib.get_close_matches``), or "".
    Takes str names. Never raises. Source: the config loader's unknown-key messages."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class DeclaredSettings:
    """The settings an entry declares: ``name`` (the entry's), ``settings_cls`` (a frozen dataclass validating in
    ``__post_init__``, every invalid value a ConfigError naming ``<section>.<key>``) and ``section`` (the dotted
    run-config section holding it, e.g. ``actor.<loss>``). Source: verl ``policy_loss.*`` (a loss's own keys)."""

    name: str
    settings_cls: type
    section: str


def settings_for(extensions: Mapping[str, Any], entry) -> Any:
    """The settings instance of a registered extension, given its declaration ``entry`` (a :class:`DeclaredSettings`,
    ``Registry.declared(name)``, or None): the one in ``extensions`` (``Config.extensions`` / ``Recipe.extensions``)
    under its section, else its ``settings_cls()`` defaults; None when ``entry`` is None (the extension declares
    none). Never raises (but as the class's own check of its defaults). Source: this module's rule."""
    if entry is None:
        return None
    return extensions.get(entry.section) or entry.settings_cls()


def settings_keywords(owner: str, settings_cls: type | None, settings: Any = None) -> dict[str, Any]:
    """``{field: value}`` of ``settings`` (an instance of ``settings_cls``; None: ``settings_cls()``), the keywords
    an extension's function takes; ``{}`` when ``settings_cls`` is None. ``owner`` names the extension in messages
    (``"policy loss 'x'"``). Raises: TypeError for settings that are not a ``settings_cls``.
    Source: the reward kinds' rule (every field of the settings is a keyword of the function)."""
    if settings_cls is None:
        return {}
    settings = settings_cls() if settings is None else settings
    if not isinstance(settings, settings_cls):
        raise TypeError(f"{owner} takes {settings_cls.__name__} settings, got {type(settings).__name__}")
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}


class Registry(dict):
    """``name -> entry``, filled where the entries are defined (:meth:`register`), looked up by name.

    Args: kind: what it holds, for messages ("policy loss"); key: the config key that names an entry
      ("actor.policy_loss"); homes: dotted modules that register entries; packages: dotted packages each of whose
      modules is imported (entries registered in new files there are found).
    Reading (``[]``, ``in``, iteration, ``get``, ``len``) imports the homes and packages first (once).
    Source: verl ``core_algos.register_policy_loss`` / ``get_policy_loss_fn``.
    """

    def __init__(self, kind: str, key: str, homes: tuple = (), packages: tuple = ()):
        super().__init__()
        self.kind, self.key, self.homes, self.packages = kind, key, tuple(homes), tuple(packages)
        self._loaded = False
        self._declared: dict[str, DeclaredSettings] = {}

    def register(self, name: str, make: Callable = lambda fn: fn, *, settings_cls: type | None = None,
                 section: str | None = None) -> Callable:
        """A decorator storing ``make(fn)`` as ``self[name]`` and returning ``fn`` unchanged. ``settings_cls`` /
        ``section``: the entry's own settings and the dotted run-config section holding them (:meth:`declared`).
        Raises: ValueError if ``name`` is already registered, or for ``settings_cls`` without a ``section`` (or
        the reverse). Source: verl ``register_policy_loss``; verl ``policy_loss.*`` (a loss's own keys)."""
        if (settings_cls is None) != (section is None) or section == "":
            raise ValueError(f"{self.kind} {name!r}: settings_cls and section go together (got "
                             f"settings_cls={settings_cls!r}, section={section!r})")

        def deco(fn):
            if dict.__contains__(self, name):
                raise ValueError(f"{self.kind} {name!r} is already registered")
            dict.__setitem__(self, name, make(fn))
            self._declared.pop(name, None)
            if settings_cls is not None:
                self._declared[name] = DeclaredSettings(name, settings_cls, section)
            return fn

        return deco

    def declared(self, name: str) -> DeclaredSettings | None:
        """The settings the registered entry ``name`` declares, or None (no settings, or no such entry: a
        declaration outlives an entry removed from the dict and is then ignored). Never raises (but as
        :meth:`load`). Source: this module's rule."""
        return self._declared.get(name) if name in self else None

    def bound(self, name: str, extensions: Mapping[str, Any] | None = None) -> Callable:
        """The function entry ``name`` (:meth:`lookup`) with its declared settings bound as keywords
        (``functools.partial(fn, **fields)`` of ``extensions[section]``, else of ``settings_cls()``); the entry
        itself when it declares none (so a built-in is called exactly as before). ``extensions``: ``{dotted
        section: settings instance}`` (``Recipe.extensions``, ``Config.extensions``).
        Raises: ConfigError as :meth:`lookup`; TypeError for settings of the wrong class.
        Source: verl ``get_policy_loss_fn`` / ``get_adv_estimator_fn`` (lookup by name), the loss reading its own
        ``policy_loss.*`` keys."""
        fn, declared = self.lookup(name), self.declared(name)
        if declared is None:
            return fn
        settings = settings_for(extensions or {}, declared)
        return functools.partial(fn, **settings_keywords(f"{self.kind} {name!r}", declared.settings_cls, settings))

    def load(self) -> "Registry":
        """Import the homes and every module of the packages (once), so that every entry is registered.
        Raises: ImportError from a module that does not import. Source: this module's rule."""
        if not self._loaded:
            self._loaded = True  # first: a module being imported may read the registry
            for module in self.homes:
                importlib.import_module(module)
            for package in self.packages:
                pkg = importlib.import_module(package)
                for info in pkgutil.iter_modules(pkg.__path__):
                    importlib.import_module(f"{package}.{info.name}")
        return self

    def names(self) -> list[str]:
        """The registered names, sorted (after :meth:`load`). Never raises (but as :meth:`load`)."""
        return sorted(dict.keys(self.load()))

    def lookup(self, name: str, extra: tuple = ()):
        """The entry registered as ``name``. ``extra``: names that are valid without an entry (e.g. ``"none"``);
        they return None.
        Raises: ConfigError ``"<key>: 'x' is not a registered <kind>; did you mean 'y'? registered: [...]"``.
        Source: verl ``get_policy_loss_fn`` (lookup by name), with the config loader's did-you-mean."""
        self.load()
        if name in extra:
            return None
        if not isinstance(name, str) or not dict.__contains__(self, name):
            known = list(extra) + self.names()
            raise ConfigError(f"{self.key}: {name!r} is not a registered {self.kind}{did_you_mean(name, known)} "
                              f"(registered: {known})")
        return dict.__getitem__(self, name)

    def __getitem__(self, name):
        return dict.__getitem__(self.load(), name)

    def __contains__(self, name) -> bool:
        return dict.__contains__(self.load(), name)

    def __iter__(self):
        return dict.__iter__(self.load())

    def __len__(self) -> int:
        return dict.__len__(self.load())

    def get(self, name, default=None):
        """``dict.get`` after :meth:`load`: a missing name gives ``default``; raises what :meth:`load` raises."""
        return dict.get(self.load(), name, default)

    def keys(self):
        """``dict.keys`` after :meth:`load`."""
        return dict.keys(self.load())

    def items(self):
        """``dict.items`` after :meth:`load`."""
        return dict.items(self.load())

    def values(self):
        """``dict.values`` after :meth:`load`."""
        return dict.values(self.load())
