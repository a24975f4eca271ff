"""Registries by name (verl ``core_algos``' ``register_adv_est`` / ``register_policy_loss`` pattern): the advantage
estimators, policy losses, token masks, mask strategies and reward kinds.

A :class:`Registry` is a dict filled by its ``register`` decorator in the module that defines each entry. It names
those modules itself (``homes``: the modules holding entries; ``packages``: folders whose every module may hold
entries, so that adding an entry is one new file there) and imports them before any lookup, so a lookup never
depends on what its caller happened to import. A name it does not know is a :class:`ConfigError` naming the
config key, with the closest registered name (``difflib``).
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Callable, Iterable

from stapo_jax.core.errors import ConfigError

__all__ = ["Registry", "did_you_mean"]


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known`` to ``name`` (``difflib.get_close_matches``), or "".
    Takes str names. Never raises. Source: the config loader's unknown-key messages."""
    close = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


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

    def register(self, name: str, make: Callable = lambda fn: fn) -> Callable:
        """A decorator storing ``make(fn)`` as ``self[name]`` and returning ``fn`` unchanged.
        Raises: ValueError if ``name`` is already registered. Source: verl ``register_policy_loss``."""

        def deco(fn):
            if dict.__contains__(self, name):
                raise ValueError(f"{self.kind} {name!r} is already registered")
            dict.__setitem__(self, name, make(fn))
            return fn

        return deco

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
