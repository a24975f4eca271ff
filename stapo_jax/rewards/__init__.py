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
run in a :class:`VerifierPool`: a ``pebble.ProcessPool`` (forkserver context where available, else spawn;
never fork, so the JAX parent is not forked) created once and reused. Each item runs in a worker's main
thread (math-verify uses ``signal.alarm``) under a hard per-item timeout: a worker that exceeds it, for
instance stuck in a C-level big-integer power that no signal can interrupt, is killed and replaced. A
timed-out or crashed verifier scores 0 and is counted (``n_timeout``, ``n_error``); the run goes on. Model
output is parsed, never evaluated.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import functools
import logging
import multiprocessing
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

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


class VerifierPool:
    """A reusable process pool that runs one function call per item with a hard per-item timeout.

    Args:
      num_workers: worker processes (>= 1).
      preload: modules the workers import at start (forkserver: imported once in the fork server).
      initializer: optional no-argument callable run in each worker at start (module-level, picklable).

    Use as a context manager or call :meth:`close`. Source: the process-pool design of MaxText
    ``trainers/post_train/rl/math_verify_pool.py`` (conventions.md §8), with pebble for kill-on-timeout.
    """

    def __init__(self, num_workers: int, preload: Sequence[str] = (), initializer: Optional[Callable] = None):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        import pebble

        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if ctx.get_start_method() == "forkserver" and preload:
            ctx.set_forkserver_preload(list(preload))
        self.num_workers = num_workers
        self._pool = pebble.ProcessPool(max_workers=num_workers, initializer=initializer, context=ctx)
        self._closed = False

    def run(self, fn: Callable[..., Any], arg_tuples: Sequence[tuple], timeout_s: float) -> list[tuple[str, Any]]:
        """Call ``fn(*args)`` for every tuple in a worker; returns ``[(status, value), ...]`` in input order.

        ``status`` is ``"ok"`` (value = the return value), ``"timeout"`` (the call ran longer than
        ``timeout_s`` seconds of wall time in its worker; value None), or ``"error"`` (it raised, or its
        worker died; value = the exception's repr).

        Raises:
          RuntimeError: the pool was closed.
        """
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        import pebble

        futures = [self._pool.schedule(fn, args=args, timeout=timeout_s) for args in arg_tuples]
        out: list[tuple[str, Any]] = []
        for fut in futures:
            try:
                out.append(("ok", fut.result()))
            except concurrent.futures.TimeoutError:
                out.append(("timeout", None))
            except pebble.ProcessExpired as e:
                out.append(("error", f"worker died: {e!r}"))
            except Exception as e:  # the verifier raised: counted, never fatal
                out.append(("error", repr(e)))
        return out

    def close(self) -> None:
        """Stop the workers (running calls are terminated) and wait for them to exit. Idempotent."""
        if not self._closed:
            self._closed = True
            self._pool.stop()
            self._pool.join()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RewardScorer:
    """Scores batches of responses with one verifier kind; owns its :class:`VerifierPool` (if pooled).

    Args:
      kind: a registered reward kind (:data:`stapo_jax.rewards.registry.REWARD_KINDS`).
      timeout_s: per-item wall-clock limit for pooled verifiers (seconds).
      num_workers: pool size for pooled verifiers.
      boxed_normalize: string match after DAPO's normalisation (``reward.boxed_normalize``).
      gym_task: reasoning-gym task name (required for ``kind="gym"``).
      gym_answer_format: ``boxed | answer_tag | raw`` (:func:`stapo_jax.rewards.gym.extract_answer`).
      rel_tol: ``math_verify_strict``: relative tolerance for answers with decimals (> 0).
      require_think_close: ``math_verify_strict``: a response without ``</think>`` has no answer (thinking
        templates that pre-fill ``<think>`` in the prompt).
    """

    def __init__(self, kind: str, *, timeout_s: float = 10.0, num_workers: int = 4, boxed_normalize: bool = False,
                 gym_task: Optional[str] = None, gym_answer_format: str = "boxed", rel_tol: float = 1e-9,
                 require_think_close: bool = False):
        self.entry = get_reward_kind(kind)  # ConfigError (a ValueError) for an unknown kind, with did-you-mean
        if "gym_task" in self.entry.requires and not gym_task:
            raise ValueError(f"reward kind {kind!r} needs gym_task (data.gym.task)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if not rel_tol > 0:
            raise ValueError(f"rel_tol={rel_tol} must be > 0")
        self.rel_tol, self.require_think_close = float(rel_tol), bool(require_think_close)
        self.kind, self.timeout_s, self.boxed_normalize = kind, float(timeout_s), boxed_normalize
        self.gym_task, self.gym_answer_format = gym_task, gym_answer_format
        self._keywords = self.entry.keywords({"boxed_normalize": boxed_normalize, "rel_tol": self.rel_tol,
                                              "require_think_close": self.require_think_close,
                                              "gym_task": gym_task, "gym_answer_format": gym_answer_format})
        self._pool: Optional[VerifierPool] = None
        if self.entry.pooled:
            module = self.entry.module
            init = getattr(__import__(module, fromlist=["init_worker"]), "init_worker", None)
            self._pool = VerifierPool(num_workers, preload=[module], initializer=init)

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
          a gym score of 1), ``score_mean`` and ``time_s``.

        Raises:
          ValueError: ``len(responses) != len(golds)``.
          TypeError: a response is not a str, or a gold of the wrong type (message gives the index).
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
                 "score_mean": float(scores.mean()) if n else 0.0, "time_s": time.perf_counter() - t0}
        return scores, stats

    def close(self) -> None:
        """Shut the worker pool down (no-op for inline kinds). Idempotent."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def make_scorer(cfg) -> RewardScorer:
    """A :class:`RewardScorer` from a run :class:`~stapo_jax.config.schema.Config` (``reward.*``, ``data.gym.task``).

    No arrays: reads the scalar (str / float / int / bool) fields ``reward.kind``, ``reward.timeout_s``,
    ``reward.num_workers``, ``reward.boxed_normalize``, ``reward.gym_answer_format`` and ``data.gym.task``.
    Raises ValueError (from :class:`RewardScorer`) for an unknown kind, ``kind: gym`` without a task, a
    non-positive ``timeout_s``, or ``num_workers < 1`` for a pooled kind. Source: the project's config
    convention (``docs/conventions.md``).
    """
    r = cfg.reward
    return RewardScorer(r.kind, timeout_s=r.timeout_s, num_workers=r.num_workers, boxed_normalize=r.boxed_normalize,
                        gym_task=cfg.data.gym.task, gym_answer_format=r.gym_answer_format)


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

    No arrays: returns a dict of tuple keys (str / float / int / bool fields) to scorers. Source: this module's
    scorer cache (no peer equivalent).
    """
    with _SCORERS_LOCK:
        return dict(_SCORERS)


@atexit.register
def shutdown() -> None:
    """Close every scorer created by :func:`score` (their worker pools) and forget them. Never raises.

    No arrays, returns None. Source: this module's scorer cache (no peer equivalent).
    """
    with _SCORERS_LOCK:
        for scorer in _SCORERS.values():
            scorer.close()
        _SCORERS.clear()
