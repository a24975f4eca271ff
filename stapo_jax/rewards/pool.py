"""The verifier process pool, supervised: a ``pebble.ProcessPool`` that is rebuilt when it breaks.

Workers start from a forkserver (where available, else spawn; never fork, so the JAX parent is not forked), are
created once and reused, and run each item in their main thread (math-verify uses ``signal.alarm``) under a
hard per-item timeout: a worker that exceeds it is killed and replaced by pebble. A verifier that raises scores
0 and is counted; model output is parsed, never evaluated.

Supervision (issue 34). pebble marks a pool broken for good, and every later ``schedule`` raises
``RuntimeError("Unexpected error within the Pool")``, when one of its three manager threads ends (any exception
other than ``BrokenProcessPool`` in them) or when a worker ends with a non-zero code while no item is running
(``find_expired_task``: "All workers expired"). With a forkserver the second happens whenever the forkserver
dies: the parent then reads every worker's exit status as 255 (``popen_forkserver.poll``), so an idle pool
breaks at its next 0.1 s status check. Items queued in a broken pool never complete. :meth:`VerifierPool.run`
therefore

* waits for results in 0.5 s slices, checking ``pool.active`` (pebble's own health check) in between;
* on a broken pool (``schedule`` refused, ``BrokenProcessPool``, a manager thread dead), a stalled pool (no
  item finished for ``timeout_s + 240`` s while items are pending) or a worker that died under an item, stops
  the pool (bounded, in a daemon thread), starts a new one (a new forkserver if the old one is dead) and
  re-scores the items without a verdict; each rebuild is counted (:attr:`VerifierPool.n_restarts`, the
  trainer's ``reward/n_pool_restarts``);
* scores an item whose worker died under it twice as an error (the item itself kills workers: a verifier
  crash, not the pool);
* raises :class:`PoolFailure`, one line naming the last cause, when the same batch needs more than
  ``max_restarts`` rebuilds (``reward.max_pool_restarts``).

Signals and lifetime. The pool's processes never see a SIGTERM sent to the trainer's whole process group
(``timeout``, a scheduler's time limit, ``kill -- -PGID``; the trainer takes it as "checkpoint after this step"
and closes the pool itself), so a group SIGTERM costs no rebuild: the pool is started with SIGTERM blocked in the
starting thread (:func:`sigterm_blocked`), so pebble's threads, the forkserver they start and every worker forked
from it inherit the blocked mask (signal masks survive ``fork`` and ``exec``); the forkserver keeps it (a group
SIGTERM stays pending there, never delivered), and each worker, in :func:`worker_init`, leaves the trainer's
process group, drops a SIGTERM that arrived while it was blocked and unblocks it (pebble stops workers with a
SIGTERM of their own). The pool's processes still end with the trainer, however it ends: each worker exits when
the trainer's end of a lifeline pipe closes (:func:`watch_owner`, even in the middle of an item), and then the
forkserver (its "alive" pipe) and CPython's resource tracker; a SIGKILLed trainer leaves no pool process behind.

Source: the process-pool design of MaxText ``trainers/post_train/rl/math_verify_pool.py`` (conventions.md §8),
pebble 5's ``ProcessPool`` for kill-on-timeout.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Optional, Sequence


log = logging.getLogger(__name__)

STALL_SLACK_S = 240.0  # no item finished for timeout_s + this long while items are pending: the pool is stuck
#                       (generous: 8 workers starting and warming up sympy took > 70 s under a load average of 27)
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what a job's process group or a terminal's Ctrl-C sends
STOP_TIMEOUT_S = 15.0  # bound on stopping one pebble pool (its threads are daemons; leftovers are abandoned)
WAIT_SLICE_S = 0.5


@contextlib.contextmanager
def sigterm_blocked():
    """Block SIGTERM and SIGINT (:data:`GROUP_SIGNALS`) in the calling thread for the ``with`` body
    (``pthread_sigmask``); the previous mask after.

    Threads and processes started inside inherit the blocked mask (POSIX: a new thread takes its creator's mask,
    ``fork`` and ``exec`` keep it), which keeps a SIGTERM sent to the trainer's process group, or a Ctrl-C's SIGINT
    to the terminal's foreground group, away from them.
    A SIGTERM for the trainer itself is delivered to another thread, or to this one when the body ends. No-op
    where ``signal.pthread_sigmask`` does not exist (Windows). Raises nothing of its own. Source:
    POSIX ``pthread_sigmask(2)``, ``signal(7)`` (masks across fork / exec).
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, set(GROUP_SIGNALS))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def watch_owner(lifeline) -> None:
    """End this process (``os._exit(1)``) as soon as the pool's owner ends, however it ends (SIGKILL included).

    A daemon thread blocks reading ``lifeline``, the read end of a pipe whose only write end the owner holds
    (:class:`VerifierPool`): the read returns EOF when the owner dies or closes the pool. A parent-death signal
    cannot do this: a worker's parent is the forkserver, which exits only when every holder of its "alive" fd
    has, and CPython hands that fd to each forkserver child, so a worker busy with an item outlived a SIGKILLed
    trainer (and kept the forkserver alive) until the item ended, which nobody then bounded.
    ``lifeline``: a ``multiprocessing.connection.Connection``. Returns None; raises nothing of its own
    (RuntimeError only if a thread cannot be started). Source: the "alive pipe" of CPython's
    ``multiprocessing.forkserver``.
    """
    def watch() -> None:
        try:
            while True:
                lifeline.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)

    threading.Thread(target=watch, name="pool-owner-watch", daemon=True).start()


def worker_init(initializer: Optional[Callable] = None, lifeline=None) -> None:
    """Start of every pool worker: end with the owner, leave its process group, take SIGTERM again, then run
    ``initializer``.

    ``lifeline`` (optional): the read end of the owner's lifeline pipe (:func:`watch_owner`). The worker was
    started with SIGTERM blocked (:func:`sigterm_blocked`): after ``os.setpgrp`` a SIGTERM sent to the owner's
    group no longer reaches it, one that arrived before is dropped, and SIGTERM is unblocked so pebble can stop
    the worker (pebble's handler exits with code 15). A group SIGTERM used to make every idle worker exit and the
    pool break while the trainer, which takes SIGTERM as "stop after this step", still had to score.
    Returns None; raises what ``initializer`` raises. Source: POSIX process groups (``setpgid(0, 0)``),
    ``sigpending(2)``.
    """
    if lifeline is not None:
        watch_owner(lifeline)
    os.setpgrp()
    if hasattr(signal, "pthread_sigmask"):
        for sig in set(GROUP_SIGNALS) & signal.sigpending():  # sent to the group before setpgrp: drop it
            handler = signal.signal(sig, signal.SIG_IGN)  # ignoring discards a pending signal
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(GROUP_SIGNALS))
    if initializer is not None:
        initializer()


class PoolFailure(RuntimeError):
    """The verifier pool broke more than ``reward.max_pool_restarts`` times on the same batch (one-line message
    naming the last cause)."""


class VerifierPool:
    """A reusable, self-repairing process pool that runs one function call per item with a hard per-item timeout.

    Args:
      num_workers: worker processes (>= 1).
      preload: modules the workers import at start (forkserver: imported once in the fork server).
      initializer: optional no-argument callable run in each worker at start (module-level, picklable).
      max_restarts: rebuilds allowed while scoring one batch (>= 0); one more raises :class:`PoolFailure`.
      on_progress: optional no-argument callable run after each item that finishes (a progress mark).

    Use as a context manager or call :meth:`close`. Raises ValueError for ``num_workers < 1`` or
    ``max_restarts < 0``. Source: MaxText ``math_verify_pool.py`` (conventions.md §8), with pebble.
    """

    def __init__(self, num_workers: int, preload: Sequence[str] = (), initializer: Optional[Callable] = None,
                 max_restarts: int = 3, on_progress: Optional[Callable[[], None]] = None):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers} must be >= 1")
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts} must be >= 0")
        methods = multiprocessing.get_all_start_methods()
        self._ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self._ctx.get_start_method() == "forkserver" and preload:
            self._ctx.set_forkserver_preload(list(preload))
        self.num_workers, self.max_restarts, self._initializer = num_workers, int(max_restarts), initializer
        self.n_restarts = 0  # rebuilds over the pool's life
        self.on_progress = on_progress  # called after each item that finishes (the trainer's stall watchdog mark)
        self._closed = False
        # the workers' lifeline (watch_owner): they keep the read end, only this process the write end
        self._lifeline_r, self._lifeline_w = self._ctx.Pipe(duplex=False)
        self._pool = self._new_pool()

    def _new_pool(self):
        import pebble

        # CPython starts the resource tracker with SIGTERM blocked and then unblocks it in the calling thread
        # (bpo-33613), which would lift our mask before the forkserver starts: start the tracker first.
        multiprocessing.resource_tracker.ensure_running()
        with sigterm_blocked():  # pebble's threads, the forkserver and the workers inherit the mask (module doc)
            pool = pebble.ProcessPool(max_workers=self.num_workers, context=self._ctx,
                                      initializer=functools.partial(worker_init, self._initializer, self._lifeline_r))
            _ = pool.active  # pebble starts its threads and workers on first use: now, under the mask
        return pool

    @staticmethod
    def _stop(pool) -> bool:
        """Stop a pebble pool within :data:`STOP_TIMEOUT_S`; False when its join did not finish in time.

        Its workers are killed first: pebble's join unlinks the pool's channel locks before it stops the workers,
        so a worker still starting in the forkserver died printing a FileNotFoundError traceback
        (``SemLock._rebuild``) when a pool closed right after it started (a run failing in setup). Running calls
        are terminated either way (pebble: SIGTERM, blocked in the workers, then SIGKILL after 3 s)."""
        pool.stop()  # STOPPED first: pebble's manager starts no replacement for the workers killed below
        manager = getattr(getattr(pool, "_pool_manager", None), "worker_manager", None)
        for worker in tuple(getattr(manager, "workers", {}).values()):
            try:
                worker.kill()
            except (OSError, ValueError, AttributeError):  # already gone, or never started
                pass
        t = threading.Thread(target=pool.join, name="verifier-pool-stop", daemon=True)
        t.start()
        t.join(STOP_TIMEOUT_S)
        return not t.is_alive()

    def restart(self, cause: str) -> None:
        """Replace the pebble pool by a fresh one (logged with ``cause``, counted in :attr:`n_restarts`).

        A str in, None out. Raises RuntimeError if the pool was closed. Source: this module's design.
        """
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        log.warning("reward pool: %s; rebuilding it (%d workers) and re-scoring the items without a verdict",
                    cause, self.num_workers)
        if not self._stop(self._pool):
            log.warning("reward pool: the old pool did not stop within %.0f s; abandoning it", STOP_TIMEOUT_S)
        self._pool = self._new_pool()
        self.n_restarts += 1

    def run(self, fn: Callable[..., Any], arg_tuples: Sequence[tuple], timeout_s: float) -> list[tuple[str, Any]]:
        """Call ``fn(*args)`` for every tuple in a worker; returns ``[(status, value), ...]`` in input order.

        ``status`` is ``"ok"`` (value = the return value), ``"timeout"`` (the call ran longer than
        ``timeout_s`` seconds of wall time in its worker; value None), or ``"error"`` (it raised, value = the
        exception's repr; or its worker died under it twice, value starts with ``"worker died"``). A broken pool
        is rebuilt and the items without a verdict re-scored (module docstring).

        Raises:
          RuntimeError: the pool was closed.
          PoolFailure: more than ``max_restarts`` rebuilds for this call.
        Python objects in and out. Source: MaxText ``math_verify_pool.py`` (conventions.md §8).
        """
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        n = len(arg_tuples)
        out: list[Optional[tuple[str, Any]]] = [None] * n
        deaths = [0] * n
        restarts = 0
        cause = None if self._pool.active else "the pool broke while idle (a dead worker or forkserver)"
        todo = list(range(n))
        while True:
            if cause is not None:
                restarts += 1
                if restarts > self.max_restarts:
                    raise PoolFailure(f"reward pool failed {restarts} times on one batch of {n} items (last: {cause});"
                                      f" stopping (reward.max_pool_restarts={self.max_restarts}; check memory / the "
                                      f"OOM killer and reward.num_workers)")
                self.restart(cause)
            todo = [i for i in todo if out[i] is None]
            if not todo:
                return out  # type: ignore[return-value]
            cause = self._run_once(fn, arg_tuples, todo, timeout_s, out, deaths)

    def _run_once(self, fn, arg_tuples, todo, timeout_s, out, deaths) -> Optional[str]:
        """Schedule ``todo`` once and fill ``out``; returns why the pool must be rebuilt, or None."""
        import pebble

        try:
            futures = {self._pool.schedule(fn, args=arg_tuples[i], timeout=timeout_s): i for i in todo}
        except RuntimeError as e:  # pebble: "Unexpected error within the Pool"
            return f"pebble refused the items ({e})"
        pending, cause, died = set(futures), None, 0
        last = time.monotonic()
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=WAIT_SLICE_S)
            for fut in done:
                i, last = futures[fut], time.monotonic()
                if self.on_progress is not None:
                    self.on_progress()
                try:
                    out[i] = ("ok", fut.result())
                except concurrent.futures.TimeoutError:
                    out[i] = ("timeout", None)
                except pebble.ProcessExpired as e:
                    deaths[i] += 1
                    died += 1
                    if deaths[i] >= 2:
                        out[i] = ("error", f"worker died twice under this item: {e!r}")
                except (BrokenProcessPool, concurrent.futures.CancelledError) as e:
                    cause = cause or f"pebble aborted the pending items ({e!r})"
                except Exception as e:  # the verifier raised: counted, never fatal
                    out[i] = ("error", repr(e))
            if pending and not self._pool.active:
                return f"pebble reports the pool broken ({len(pending)} items pending: a manager thread died or " \
                       f"all workers expired)"
            if pending and time.monotonic() - last > timeout_s + STALL_SLACK_S:
                return f"no item finished for {time.monotonic() - last:.0f} s with {len(pending)} pending"
        if cause is None and any(out[i] is None for i in todo):
            cause = f"a worker died under {died} item(s) (a killed worker or forkserver)"
        return cause

    def close(self) -> None:
        """Stop the workers (running calls are terminated) and wait for them, at most ~15 s. Idempotent; never
        raises. Source: pebble's ``stop`` / ``join``."""
        if not self._closed:
            self._closed = True
            if not self._stop(self._pool):
                log.warning("reward pool: did not stop within %.0f s; abandoning it", STOP_TIMEOUT_S)
            self._lifeline_w.close()  # any worker left ends now (watch_owner)
            self._lifeline_r.close()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
