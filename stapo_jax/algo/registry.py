"""One way to register things by name (verl ``core_algos``' ``register_adv_est`` / ``register_policy_loss``
pattern), used by the advantage estimators, the policy losses and the token masks."""

from __future__ import annotations

from typing import Callable

__all__ = ["register_into"]


def register_into(table: dict, kind: str, name: str, make: Callable = lambda fn: fn) -> Callable:
    """A decorator that stores ``make(fn)`` as ``table[name]`` and returns ``fn`` unchanged.

    Args: table: the registry dict; kind: what is registered, for the error message; name: its key;
      make: builds the stored entry from the function (default: the function itself).
    Raises: ValueError if ``name`` is already in ``table``.
    Source: verl ``core_algos.register_adv_est`` / ``register_policy_loss`` (same duplicate-name error).
    Takes no arrays (``name``: str).
    """

    def deco(fn):
        if name in table:
            raise ValueError(f"{kind} {name!r} is already registered")
        table[name] = make(fn)
        return fn

    return deco
