"""Stall watchdog (``trainer.stall_timeout_s``): a process that makes no progress for that long dumps every Python
thread's stack and its current phase to its log and exits with :data:`EXIT_STALL`, so a scheduler restarts it and
the run resumes from its last checkpoint.

The trainer marks progress at phase boundaries (``setup``, ``sft``, ``eval``, ``rollout``, ``reward``, ``update``,
``sync``, ``checkpoint``, ``export``) with :meth:`StallWatchdog.mark`; long phases mark progress from inside
(:func:`progress`: every decode step of the rollout driver, every verified item of the reward pool, every
program ``trainer.precompile`` compiles). A daemon
thread wakes every ``min(1 s, timeout / 10)``; when the last mark is older than the timeout it writes one line
naming the phase, the RL step and the process, then ``faulthandler.dump_traceback(all_threads=True)``, waits
``min(5 s, timeout / 10)`` and calls ``os._exit(EXIT_STALL)`` (no ``atexit`` handler, no thread join can keep it
alive). In a multi-process run the other processes stall in their next collective and their own watchdogs fire
within about a second (the grace period lets them dump their stacks first); a peer that is still running when
one exits fails in its next collective or on JAX's heartbeat (``runtime/distributed.py``), non-zero as well.

Exit code :data:`EXIT_STALL` = 75 (``EX_TEMPFAIL`` of BSD ``sysexits.h``: a temporary failure, retrying may work).

Test hook: :data:`HANG_ENV` (``STAPO_TEST_HANG=PROCESS:PHASE[:STEP]``) makes process ``PROCESS`` sleep forever
when it marks ``PHASE`` (in RL step ``STEP`` if given), so tests can inject a hang in one process of a run.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

EXIT_STALL = 75
HANG_ENV = "STAPO_TEST_HANG"
DEFAULT_TIMEOUT_S = {"cpu": 600.0, "accelerator": 1800.0}
GRACE_S = 5.0  # between the stack dump and the exit (at most a tenth of the timeout)

_active: Optional["StallWatchdog"] = None
_active_lock = threading.Lock()


def resolve_timeout(value: Optional[float], backend: str) -> float:
    """``trainer.stall_timeout_s`` in seconds: ``value`` if set (0 = off), else 600 s on the ``"cpu"`` backend and
    1800 s on accelerators (``"gpu"``, ``"tpu"``, ...).

    A float / None and a str in, a float out. Raises ValueError for a negative value. Source: this
    project's stall bound (issue 34; a 0.6B update compiles in minutes, never in half an hour).
    """
    if value is None:
        return DEFAULT_TIMEOUT_S["cpu" if backend == "cpu" else "accelerator"]
    if value < 0:
        raise ValueError(f"trainer.stall_timeout_s={value} must be >= 0 (0 = off)")
    return float(value)


HEARTBEAT_MARGIN_S = 30.0  # between the watchdog's exit (limit + poll + grace) and JAX's heartbeat abort


def heartbeat_floor(stall_timeout_s: Optional[float], backend: Optional[str] = None) -> Optional[int]:
    """The JAX heartbeat timeout (int seconds) a run with ``trainer.stall_timeout_s`` needs so that, when a peer
    stops (kill -STOP, a hung host), the watchdog of a process waiting on it fires, dumps its stacks and exits
    :data:`EXIT_STALL` before JAX's heartbeat aborts the job: limit + 1 s poll + :data:`GRACE_S` +
    :data:`HEARTBEAT_MARGIN_S`. ``stall_timeout_s`` None: the backend's default (``backend`` None, before JAX
    picked one: the larger, accelerator default); 0 (watchdog off): None. Raises ValueError for a negative
    value. Source: issue 43 (the heartbeat's C++ abort used to come first, at 100 s against 600 s)."""
    limit = max(DEFAULT_TIMEOUT_S.values()) if stall_timeout_s is None and backend is None else \
        resolve_timeout(stall_timeout_s, backend or "cpu")
    if limit == 0:
        return None
    return int(limit + 1.0 + GRACE_S + HEARTBEAT_MARGIN_S + 0.999)


def parse_hang(spec: Optional[str]) -> Optional[tuple[int, str, Optional[int]]]:
    """The test hook :data:`HANG_ENV` parsed: ``"1:reward:2"`` -> ``(1, "reward", 2)``; None for unset / empty.

    Str in, a (process int, phase str, step int or None) tuple out. Raises ValueError naming
    ``STAPO_TEST_HANG`` for a malformed value. Source: this project's test hook (no peer equivalent).
    """
    if not spec:
        return None
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or not parts[1]:
            raise ValueError
        return int(parts[0]), parts[1], (int(parts[2]) if len(parts) == 3 else None)
    except ValueError:
        raise ValueError(f"{HANG_ENV}={spec!r}: expected PROCESS:PHASE[:STEP], e.g. 1:reward:2") from None


class StallWatchdog:
    """Exits the process (code :data:`EXIT_STALL`) with all thread stacks when no :meth:`mark` / :func:`progress`
    happened for ``timeout_s`` seconds (wall clock, ``time.monotonic``). ``timeout_s=0`` makes it inert.

    Args:
      timeout_s: stall bound in seconds (>= 0; 0 = off).
      process_index: this process's index (named in the stall line and matched by :data:`HANG_ENV`).
      stream: where the stall line and the stacks go (needs a ``fileno``; default ``sys.stderr``, else
        ``sys.__stderr__``).
      exit_fn: called with :data:`EXIT_STALL` after the dump (default ``os._exit``; tests pass a recorder).

    Use as a context manager (starts the thread and makes it the target of :func:`progress`), or :meth:`start` /
    :meth:`stop`. Raises ValueError for a negative timeout or a malformed :data:`HANG_ENV`. Source: the stall
    detectors of large-scale trainers (torchelastic's ``timer``, MaxText's ``goodput`` monitor), here in-process.
    """

    def __init__(self, timeout_s: float, *, process_index: int = 0, stream=None,
                 exit_fn: Callable[[int], None] = os._exit):
        if timeout_s < 0:
            raise ValueError(f"trainer.stall_timeout_s={timeout_s} must be >= 0 (0 = off)")
        self.timeout_s, self.process_index, self.exit_fn = float(timeout_s), int(process_index), exit_fn
        self.stream = stream
        self.phase, self.step = "setup", None
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._hang = parse_hang(os.environ.get(HANG_ENV))
        self.fired = False

    def mark(self, phase: Optional[str] = None, step: Optional[int] = None) -> None:
        """Record progress now; ``phase`` / ``step`` (when given) become the current phase and RL step.

        Str / int in, None out. Never raises; sleeps forever if :data:`HANG_ENV` names this process,
        phase and step (the test hook). Source: this module's phase protocol.
        """
        self._last = time.monotonic()
        if step is not None:
            self.step = int(step)
        if phase is not None:
            self.phase = phase
            h = self._hang
            if h and h[0] == self.process_index and h[1] == phase and h[2] in (None, self.step):
                log.warning("%s=%s: process %d sleeps forever in phase %r (test hook)", HANG_ENV,
                            os.environ.get(HANG_ENV), self.process_index, phase)
                while True:
                    time.sleep(3600)

    def start(self) -> "StallWatchdog":
        """Start the watchdog thread (a daemon; nothing when ``timeout_s`` is 0) and make this the watchdog
        :func:`progress` marks. Returns self. Never raises. Source: this module's design."""
        global _active
        with _active_lock:
            _active = self
        self._last = time.monotonic()
        if self.timeout_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (joined for at most 5 s) and detach from :func:`progress`. Idempotent; never raises.
        Source: this module's design."""
        global _active
        with _active_lock:
            if _active is self:
                _active = None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> "StallWatchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def idle_s(self) -> float:
        """Seconds since the last mark (float). Never raises. Source: this module's design."""
        return time.monotonic() - self._last

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll):
            if self.idle_s() > self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        self.fired = True
        where = f"phase {self.phase!r}" + (f" of RL step {self.step}" if self.step is not None else "")
        line = (f"stall watchdog: no progress for {self.idle_s():.0f} s (trainer.stall_timeout_s={self.timeout_s:g}) "
                f"in {where} on process {self.process_index}; all thread stacks follow; exiting with code "
                f"{EXIT_STALL} so a scheduler restarts the run from its last checkpoint\n")
        out = self.stream if self.stream is not None else sys.stderr
        try:
            out.fileno()
        except (AttributeError, OSError, ValueError):
            out = sys.__stderr__
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except (OSError, ValueError):
                pass
        try:
            out.write(line)
            out.flush()
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()
            # a grace period before exiting, so the peers of a multi-process run (stalled in their next collective,
            # detected within about a second of this one) dump their own stacks before this exit breaks the job
            time.sleep(min(GRACE_S, self.timeout_s / 10))
            out.write(f"stall watchdog: exiting with code {EXIT_STALL} ({where})\n")
            out.flush()
        finally:
            self.exit_fn(EXIT_STALL)


def current_phase() -> Optional[str]:
    """The phase last marked on the running :class:`StallWatchdog` (``eval``, ``export``, ...), or None without one.
    Returns a str or None; never raises. Source: this module's phase protocol."""
    wd = _active
    return None if wd is None else wd.phase


def progress(phase: Optional[str] = None, step: Optional[int] = None) -> None:
    """Mark progress on the running :class:`StallWatchdog` (no-op without one): at phase boundaries and from inside
    long phases (decode steps, verified items). ``phase`` (str) / ``step`` (int, the RL step), when given, become
    the current phase and step.

    Returns None; never raises (except the test hook's endless sleep, see :meth:`StallWatchdog.mark`).
    Source: this module's phase protocol.
    """
    wd = _active
    if wd is not None:
        wd.mark(phase, step)


EXIT_GUARD_S = 120.0


def arm_exit_guard(code: int, timeout_s: float = EXIT_GUARD_S) -> threading.Thread:
    """Make sure the process ends: a daemon thread that, if the interpreter is still alive ``timeout_s`` seconds
    from now (a non-daemon thread, an ``atexit`` join of a child process or a stuck pool keeps it), writes one
    line to stderr and calls ``os._exit(code)`` (the status the command meant to exit with). Call it once the
    command's work is done.

    An int exit status and seconds (float) in, the (started, daemon) thread out. Never raises. Source:
    this project's exit rule (issue 34: a process that ends with an exception exits).
    """
    def guard():
        time.sleep(timeout_s)
        try:
            sys.__stderr__.write(f"stapo-jax: still alive {timeout_s:g} s after the command ended (a non-daemon "
                                 f"thread or child process); exiting with code {code}\n")
            sys.__stderr__.flush()
        finally:
            os._exit(code)

    t = threading.Thread(target=guard, name="exit-guard", daemon=True)
    t.start()
    return t
