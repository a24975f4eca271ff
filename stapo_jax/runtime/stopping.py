"""How a command stops when asked: SIGINT (Ctrl-C) and SIGTERM (a scheduler, a TPU maintenance event, the
launcher) mean the same thing.

* The first one sets :attr:`Preemption.requested`; the RL loop agrees on it over processes once per step
  (``runtime.collectives.stop_requested``), checkpoints that step and exits 0 with one line; the SFT warm-up checks it
  every 10 steps.
* A second one (either signal) stops the process at once: one line on stderr, exit code 130 (128 + SIGINT, the
  shell's code for an interrupted command), no traceback.
* A process started by ``stapo-jax launch --local N`` (:data:`LAUNCHER_PID_ENV` set) whose launcher dies (kill -9,
  a closed terminal) notices within :data:`ORPHAN_POLL_S` seconds and sends itself SIGTERM, so it stops the same
  way instead of running on unseen (:func:`watch_launcher`).

Source: POSIX signals; the shell's ``128 + N`` exit status; Kubernetes / SLURM send SIGTERM before SIGKILL.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_INTERRUPTED = 130  # 128 + SIGINT
LAUNCHER_PID_ENV = "STAPO_LAUNCHER_PID"
ORPHAN_POLL_S = 1.0


def say(line: str) -> None:
    """Write one line to the process's real stderr and flush; never raises (a closed or broken stream is
    ignored: the launcher that read it may be gone). Str in, None out. Source: this module's one-line rule."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            stream.write(line.rstrip("\n") + "\n")
            stream.flush()
            return
        except (AttributeError, OSError, ValueError):
            continue


def interrupt_on_sigterm() -> None:
    """Make SIGTERM raise ``KeyboardInterrupt("SIGTERM")`` in the main thread, as SIGINT does, so a command
    without its own stop handling (``eval``, a setup before the loop's :class:`Preemption`) ends on either with one
    line (``tools.cli``). Main thread only (``signal.signal``): raises ValueError elsewhere. Source: Python's
    ``signal.default_int_handler``."""
    def handler(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)


class Preemption:
    """SIGTERM or SIGINT: ``requested`` becomes True (the loop stops at its next agreed point, checkpoints and
    exits 0) and ``signal_name`` names the signal; a second one of either exits the process at once with
    :data:`EXIT_INTERRUPTED` after one line. ``restore()`` puts the previous handlers back. Installing needs the
    main thread (``signal.signal``); raises ValueError elsewhere. Source: SLURM / TPU preemption send SIGTERM;
    Ctrl-C sends SIGINT."""

    def __init__(self, what: str = "stopping after the current step (it is checkpointed)"):
        self.requested = False
        self.signal_name: Optional[str] = None
        self.what = what
        self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            say(f"stapo-jax: second stop signal ({name}): stopping now without a checkpoint (exit "
                f"{EXIT_INTERRUPTED})")
            os._exit(EXIT_INTERRUPTED)
        self.requested, self.signal_name = True, name
        say(f"stapo-jax: {name}: {self.what}; send it again to stop at once")

    def restore(self):
        """Put back the handlers installed before this object (call once the loop ends). Never raises."""
        for s, h in self._old.items():
            signal.signal(s, h)


def watch_launcher(launcher_pid: int, poll_s: float = ORPHAN_POLL_S) -> threading.Thread:
    """Start a daemon thread that, once this process's parent is no longer ``launcher_pid`` (the launcher died
    and the process was re-parented), points stdout / stderr at ``/dev/null`` (their reader is gone, so writes
    would fail with EPIPE) and sends this process SIGTERM once: the command then stops as on a preemption.

    An int pid and float seconds in; returns the started thread. Never raises (RuntimeError only if a thread
    cannot start). Source: ``getppid(2)`` (a process whose parent exits is re-parented to a subreaper or init).
    """
    def watch():
        while os.getppid() == launcher_pid:
            threading.Event().wait(poll_s)
        say(f"stapo-jax: the launcher (pid {launcher_pid}) is gone: stopping as on SIGTERM")
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=watch, name="launcher-watch", daemon=True)
    t.start()
    return t


def watch_launcher_from_env(environ=None) -> Optional[threading.Thread]:
    """:func:`watch_launcher` of ``$STAPO_LAUNCHER_PID`` when it is set (a process of ``stapo-jax launch``), else
    None. A str-to-str environment in. Raises ValueError naming the variable for a non-integer value. Source:
    this module's design."""
    value = (os.environ if environ is None else environ).get(LAUNCHER_PID_ENV)
    if not value:
        return None
    try:
        pid = int(value)
    except ValueError:
        raise ValueError(f"{LAUNCHER_PID_ENV}={value!r} is not a process id") from None
    return watch_launcher(pid)
