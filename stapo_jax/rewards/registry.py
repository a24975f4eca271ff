"""The reward kinds by name (``reward.kind``): each verifier registers itself in its own module with
:func:`register_reward`, saying how it is called (the scorer options it takes, whether it runs in the process pool,
the type of its gold answer); :data:`REWARD_KINDS` imports every module of ``stapo_jax.rewards`` before a lookup,
so a new reward is one new file there (DESIGN.md "Add a reward").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from stapo_jax.core.registry import Registry, settings_keywords

__all__ = ["RewardKind", "REWARD_KINDS", "register_reward", "get_reward_kind"]


@dataclass(frozen=True)
class RewardKind:
    """A registered verifier.

    name: the ``reward.kind`` value. fn: ``fn(response, gold, **keywords) -> float`` score, or ``(score, unparsed)`` where the verifier counts answers
    it could not compare safely (``reward/n_unparsed``) (a module-level function,
    so a pooled kind can be sent to a worker process). gold_type: the type of a gold answer (``str``; ``dict`` for a
    reasoning-gym entry). pooled: run in the :class:`~stapo_jax.rewards.VerifierPool` (a process per item with a
    hard timeout; the module's ``init_worker`` runs in each worker if it has one); False runs it inline.
    options: ``{fn keyword: scorer option}`` read from the :class:`~stapo_jax.rewards.RewardScorer`'s options
    (``boxed_normalize``, ``rel_tol``, ``require_think_close``, ``gym_task``, ``gym_answer_format``). fixed: constant
    keywords. requires: scorer options that must be set (``gym_task``).
    The kind's own settings class and section are not fields here: the registry keeps them
    (``REWARD_KINDS.declared(name)``, given to :func:`register_reward`).
    """

    name: str
    fn: Callable
    gold_type: type = str
    pooled: bool = False
    options: Mapping[str, str] = field(default_factory=dict)
    fixed: Mapping = field(default_factory=dict)
    requires: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """The dotted module that defines ``fn`` (the pool preloads it)."""
        return self.fn.__module__

    def keywords(self, scorer_options: Mapping, settings=None) -> dict:
        """The keyword arguments of ``fn`` (a dict) for a scorer with ``scorer_options`` (``fixed`` plus the
        ``options`` it reads) and the kind's ``settings`` (an instance of the settings class the kind declares,
        ``REWARD_KINDS.declared(name)``, every field by its name; None: that class's defaults; a kind that declares
        none takes no settings). Raises: ValueError naming a required option that is unset (None / ""),
        TypeError for settings that are not the declared class. Source: verl ``compute_score`` keywords."""
        missing = [o for o in self.requires if not scorer_options.get(o)]
        if missing:
            raise ValueError(f"reward kind {self.name!r} needs {missing}")
        declared = REWARD_KINDS.declared(self.name)  # None: the kind declares no settings of its own
        settings_cls = declared.settings_cls if declared is not None else None
        own = settings_keywords(f"reward kind {self.name!r}", settings_cls, settings)
        return {**self.fixed, **{kw: scorer_options[opt] for kw, opt in self.options.items()}, **own}


REWARD_KINDS: Registry = Registry("reward kind", "reward.kind", packages=("stapo_jax.rewards",))


def register_reward(name: str, *, settings_cls: type | None = None, section: str | None = None,
                    **spec) -> Callable:
    """Decorator registering a verifier ``fn(response, gold, **keywords) -> float`` as reward kind ``name``
    (``spec``: the fields of :class:`RewardKind`). Stack it to register one function under several names (e.g.
    with different ``fixed`` keywords). ``settings_cls``: the kind's own frozen settings dataclass (validating in
    ``__post_init__``), or None; each of its fields is passed to ``fn`` as the keyword of the same name.
    ``section``: the run-config section holding it, ``reward.<name>`` by convention (read by
    :mod:`stapo_jax.config.extensions`, passed by ``make_scorer``). Both are kept by the registry only
    (``REWARD_KINDS.declared(name)``). Returns the decorator.
    Raises: ValueError if ``name`` is taken, or for ``settings_cls`` without ``section`` (or the reverse);
    TypeError for an unknown ``spec`` field (when the decorator is applied).
    Source: verl ``register_policy_loss`` pattern; verl ``compute_score`` (one float per response)."""
    return REWARD_KINDS.register(name, lambda fn: RewardKind(name=name, fn=fn, **spec),
                                 settings_cls=settings_cls, section=section)


def get_reward_kind(name: str) -> RewardKind:
    """The registered reward kind ``name``.
    Raises: ConfigError (a ValueError) naming ``reward.kind``, the closest registered kind and all of them.
    Source: verl ``get_policy_loss_fn`` (lookup by name)."""
    return REWARD_KINDS.lookup(name)
