"""Verifiable rewards: one scalar per response, verifiers in a process pool with a per-item timeout.

Kinds (``reward.kind``, stapo_spec §2 and §10.13), each registered by its own module in
:data:`stapo_jax.rewards.registry.REWARD_KINDS` (a new kind is one new module here: DESIGN.md "Add a reward"):

* ``boxed_exact_pm1`` - JustRL/DAPO strict-box string match, +1 / -1 (:mod:`.string_match`);
* ``boxed_exact_01``  - the same match, 1 / 0;
* ``math_verify_01``  - math-verify equivalence, gold first, 1 / 0 (:mod:`.math`);
* ``math_verify_strict`` - math-verify behind a final-answer policy (last complete box, the text after
  ``</think>``; unfinished reasoning, an unterminated final box or a hedge earn nothing), normalisation and a
  magnitude-safe numeric comparison, 1 / 0 (:mod:`.math_strict`, :mod:`.answer`; issue 13);
* ``gym``             - reasoning-gym's ``score_answer`` for the entry, in [0, 1] (:mod:`.gym`);
* ``think_format``    - 1 / 0 for a ``<think>...</think>`` block at the start (TRL's format reward,
  :mod:`.think_format`).

The string match is pure Python over at most 300 characters and runs inline. math-verify and reasoning-gym
run in a :class:`VerifierPool` (:mod:`.pool`): a supervised ``pebble.ProcessPool`` (forkserver, never fork)
created once and reused, with a hard per-item timeout. A timed-out or crashed verifier scores 0 and is counted
(``n_timeout``, ``n_error``); a broken pool (dead forkserver, dead worker, dead manager thread) is rebuilt and
the affected items re-scored (``n_pool_restarts``); only more than ``reward.max_pool_restarts`` rebuilds on one
batch stop the run (:class:`PoolFailure`). Model output is parsed, never evaluated.
"""
from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from stapo_jax.core.registry import settings_for
from stapo_jax.rewards.pool import PoolFailure, VerifierPool  # noqa: F401  (public names of this package)
from stapo_jax.rewards.registry import REWARD_KINDS, get_reward_kind

log = logging.getLogger(__name__)

# the reward kinds are looked up by name in stapo_jax.rewards.registry.REWARD_KINDS (each verifier module registers
# its own); KINDS is that registry (reading it imports the verifier modules)
KINDS = REWARD_KINDS


def _run_inline(fn: Callable, response: str, gold: Any) -> tuple[str, Any]:
    """``("ok", fn(response, gold))``, or ``("error", repr)`` if it raised (counted, never fatal)."""
    try:
        return "ok", fn(response, gold)
    except Exception as e:  # defensive: the inline verifiers are total on inputs of the right type
        return "error", repr(e)


class RewardScorer:
    """Scores batches of responses with one verifier kind; owns its :class:`VerifierPool` (if pooled).

    Args:
      kind: a registered reward kind (:data:`stapo_jax.rewards.registry.REWARD_KINDS`).
      timeout_s: per-item wall-clock limit for pooled verifiers (seconds).
      num_workers: pool size for pooled verifiers.
      boxed_normalize: string match after DAPO's normalisation (``reward.boxed_normalize``).
      gym_task: reasoning-gym task name (required for ``kind="gym"``).
      gym_answer_format: ``boxed | answer_tag | raw`` (:func:`stapo_jax.rewards.gym.extract_answer`).
      settings: the kind's own settings (an instance of the class it declares, ``REWARD_KINDS.declared(kind)``, e.g.
        :class:`~stapo_jax.rewards.math_strict.MathStrictSettings` for ``math_verify_strict``: ``rel_tol``,
        ``require_think_close``); None: that class's defaults. The run config's ``reward.<kind>`` section.
      max_pool_restarts: pool rebuilds allowed per batch (``reward.max_pool_restarts``, :class:`VerifierPool`).
      on_progress: optional no-argument callable run after each verified item (the trainer passes the stall
        watchdog's progress mark).
    """

    def __init__(self, kind: str, *, timeout_s: float = 10.0, num_workers: int = 4, boxed_normalize: bool = False,
                 gym_task: Optional[str] = None, gym_answer_format: str = "boxed", settings: Any = None,
                 max_pool_restarts: int = 3, on_progress: Optional[Callable[[], None]] = None):
        self.entry = get_reward_kind(kind)  # ConfigError (a ValueError) for an unknown kind, with did-you-mean
        if "gym_task" in self.entry.requires and not gym_task:
            raise ValueError(f"reward kind {kind!r} needs gym_task (data.gym.task)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.kind, self.timeout_s, self.boxed_normalize = kind, float(timeout_s), boxed_normalize
        self.gym_task, self.gym_answer_format, self.settings = gym_task, gym_answer_format, settings
        self._keywords = self.entry.keywords({"boxed_normalize": boxed_normalize, "gym_task": gym_task,
                                              "gym_answer_format": gym_answer_format}, settings)
        self._pool: Optional[VerifierPool] = None
        if self.entry.pooled:
            module = self.entry.module
            init = getattr(__import__(module, fromlist=["init_worker"]), "init_worker", None)
            self._pool = VerifierPool(num_workers, preload=[module], initializer=init, max_restarts=max_pool_restarts,
                                      on_progress=on_progress)

    def score(self, responses: Sequence[str], golds: Sequence[Any]) -> tuple[np.ndarray, dict[str, float]]:
        """Score ``responses[i]`` against ``golds[i]``.

        Args:
          responses: N decoded responses (special tokens stripped), str.
          golds: N gold answers: str for the math kinds; the reasoning-gym entry dict
            (``{"question", "answer", "metadata"}``) for ``gym``.

        Returns:
          ``(scores, stats)``: ``scores`` float32 [N] (±1 / 0-1 per kind; 0 for a timeout or error);
          ``stats`` has ``n``, ``n_correct``, ``n_timeout``, ``n_error``, ``n_unparsed`` (``math_verify_strict``:
          a gold or answer that cannot be compared safely, scored 0), ``accuracy`` (fraction correct: a match, or
          a gym score of 1), ``score_mean``, ``time_s`` and ``n_pool_restarts`` (pool rebuilds while scoring this
          batch).

        Raises:
          ValueError: ``len(responses) != len(golds)``.
          TypeError: a response is not a str, or a gold of the wrong type (message gives the index).
          PoolFailure: the verifier pool broke more than ``max_pool_restarts`` times on this batch.
        """
        if len(responses) != len(golds):
            raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
        gold_type = self.entry.gold_type
        for i, (r, g) in enumerate(zip(responses, golds)):
            if not isinstance(r, str):
                raise TypeError(f"responses[{i}] is {type(r).__name__}, expected str")
            if not isinstance(g, gold_type):
                raise TypeError(f"golds[{i}] is {type(g).__name__}, expected {gold_type.__name__}")
        t0 = time.perf_counter()
        n = len(responses)
        scores = np.zeros(n, dtype=np.float32)
        correct = np.zeros(n, dtype=bool)
        n_timeout = n_error = n_unparsed = 0
        restarts0 = self._pool.n_restarts if self._pool is not None else 0
        fn = functools.partial(self.entry.fn, **self._keywords)
        args = list(zip(responses, golds))
        if self._pool is not None:
            results = self._pool.run(fn, args, self.timeout_s)
        else:
            results = [_run_inline(fn, r, g) for r, g in args]
        for i, (status, value) in enumerate(results):
            if status == "timeout":
                n_timeout += 1
            elif status == "error":
                n_error += 1
                log.warning("verifier error on item %d: %s", i, value)
            else:
                if isinstance(value, tuple):  # (score, unparsed): math_verify_strict's score_one
                    value, unparsed = value
                    n_unparsed += bool(unparsed)
                scores[i] = float(value)
                correct[i] = float(value) >= 1.0
        stats = {"n": float(n), "n_correct": float(correct.sum()), "n_timeout": float(n_timeout),
                 "n_error": float(n_error), "n_unparsed": float(n_unparsed),
                 "accuracy": float(correct.mean()) if n else 0.0,
                 "score_mean": float(scores.mean()) if n else 0.0, "time_s": time.perf_counter() - t0,
                 "n_pool_restarts": float(self._pool.n_restarts - restarts0 if self._pool is not None else 0)}
        return scores, stats

    def close(self) -> None:
        """Shut the worker pool down (no-op for inline kinds). Idempotent."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_scorer(reward, *, gym_task: Optional[str] = None, extensions: Optional[Mapping[str, Any]] = None,
                on_progress: Optional[Callable[[], None]] = None) -> RewardScorer:
    """A :class:`RewardScorer` from the sections of a run config it reads (not the whole config).

    Args:
      reward: the run config's ``reward`` section (``Config.reward``): its scalar fields ``kind`` (str),
        ``timeout_s`` (float), ``num_workers`` (int), ``boxed_normalize`` (bool), ``gym_answer_format`` (str) and
        ``max_pool_restarts`` (int).
      gym_task: ``data.gym.task`` (str, required for ``kind: gym``), or None.
      extensions: ``Config.extensions`` (``{dotted section: settings instance}``); the kind's own settings are
        the entry under its section (``reward.<kind>``, e.g. ``reward.math_verify_strict.rel_tol``); absent or
        None: the kind's defaults.
      on_progress: as :class:`RewardScorer`.

    Raises ValueError (from :class:`RewardScorer`) for an unknown kind, ``kind: gym`` without a task, a
    non-positive ``timeout_s``, or ``num_workers < 1`` for a pooled kind; TypeError for settings of the wrong
    class. Source: the project's config convention (``docs/conventions.md``); the kind's own section: verl's
    ``policy_loss.*`` pattern (an extension reads its own keys).
    """
    get_reward_kind(reward.kind)  # ConfigError (a ValueError) for an unknown kind, with did-you-mean
    # the kind's own settings (its section in ``extensions``, else its class's defaults; None: it declares none)
    settings = settings_for(extensions or {}, REWARD_KINDS.declared(reward.kind))
    return RewardScorer(reward.kind, timeout_s=reward.timeout_s, num_workers=reward.num_workers,
                        boxed_normalize=reward.boxed_normalize, gym_task=gym_task,
                        gym_answer_format=reward.gym_answer_format, settings=settings,
                        max_pool_restarts=reward.max_pool_restarts, on_progress=on_progress)


_SCORERS: dict[tuple, RewardScorer] = {}
_SCORERS_LOCK = threading.Lock()


def score(responses: Sequence[str], golds: Sequence[Any], kind: str, *, timeout_s: float = 10.0, num_workers: int = 4,
          boxed_normalize: bool = False, gym_task: Optional[str] = None,
          gym_answer_format: str = "boxed") -> tuple[np.ndarray, dict[str, float]]:
    """Functional form of :meth:`RewardScorer.score`; the scorer (and its pool) for each argument set is
    created on first use, reused, and shut down at interpreter exit (or by :func:`shutdown`).

    Returns / Raises: as :meth:`RewardScorer.score` (plus ValueError for an unknown ``kind``).

    Shapes / dtypes: ``responses`` and ``golds`` are length-B sequences (str responses; str golds, dict entries for
    ``gym``); returns ``(scores [B] float32, stats)`` with scalar float stats. Source: verl's ``compute_score``
    convention (one scalar reward per response).
    """
    key = (kind, float(timeout_s), int(num_workers), bool(boxed_normalize), gym_task, gym_answer_format)
    with _SCORERS_LOCK:
        scorer = _SCORERS.get(key)
        if scorer is None:
            scorer = _SCORERS[key] = RewardScorer(kind, timeout_s=timeout_s, num_workers=num_workers,
                                                  boxed_normalize=boxed_normalize, gym_task=gym_task,
                                                  gym_answer_format=gym_answer_format)
    return scorer.score(responses, golds)


def active_scorers() -> dict[tuple, RewardScorer]:
    """A copy of the scorers :func:`score` has created and not yet shut down, keyed by
    ``(kind, timeout_s, num_workers, boxed_normalize, gym_task, gym_answer_format)``. Never raises.

    Returns a dict of tuple keys (str / float / int / bool fields) to scorers. Source: this module's
    scorer cache (no peer equivalent).
    """
    with _SCORERS_LOCK:
        return dict(_SCORERS)


@atexit.register
def shutdown() -> None:
    """Close every scorer created by :func:`score` (their worker pools) and forget them. Never raises.

    Returns None. Source: this module's scorer cache (no peer equivalent).
    """
    with _SCORERS_LOCK:
        for scorer in _SCORERS.values():
            scorer.close()
        _SCORERS.clear()
