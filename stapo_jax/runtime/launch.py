"""``stapo-jax launch --local N``: rehearse a multi-host (TPU pod / SLURM) job on one machine.

Starts N copies of ``stapo-jax COMMAND ...`` (default ``train``) as the N JAX processes of one job: a free
127.0.0.1 port as ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=i``, and on CPU
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` (``--devices-per-process``) so each process simulates
D devices. Every process of the job, a one-process job included, starts ``jax.distributed``
(``STAPO_DISTRIBUTED=on``): on CPU the cross-device collectives then run through gloo in every layout, so a
rehearsal as 1 process x 4 devices sums its gradients in the same order as 2 x 2 and 4 x 1 (XLA:CPU's
in-process all-reduce, used by a process without ``jax.distributed``, sums in another order; DESIGN.md,
"Multi-process runs"). Every output line is prefixed with ``[p<i>]``; a progress bar stays one bar. When a process
exits non-zero the launcher names it and how it ended, the others get SIGTERM, then SIGKILL after ``--kill-after``
seconds; the launcher returns the first non-zero exit code (0 when all succeed). The first SIGINT (Ctrl-C) or
SIGTERM to the launcher is forwarded to every process as SIGTERM (a simulated pod maintenance event: they
checkpoint and exit 0), a second one stops them at once (exit 130). A process whose launcher dies (kill -9) stops
within a few seconds as on SIGTERM (``runtime.stopping``); a launcher whose own parent exits (a killed test
runner, a closed terminal) stops every process (SIGTERM, then SIGKILL) and exits 129, a shell's hangup status.
A mistyped launcher option (``--devics-per-process``) is an error of ``launch``, not passed on to the command.
"""
from __future__ import annotations

import argparse
import difflib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from stapo_jax.runtime.stopping import EXIT_INTERRUPTED, LAUNCHER_PID_ENV

EXIT_ORPHANED = 129  # 128 + SIGHUP: the launcher's parent is gone


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.
    Returns a Python int port. Raises OSError when no socket can be bound. Source: the OS's
    ephemeral port (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_env(i: int, n: int, port: int, devices: Optional[int], base: Optional[dict] = None) -> dict:
    """The environment of process ``i`` of ``n``: coordinator, process count/id, ``STAPO_DISTRIBUTED=on`` (also
    for ``n`` = 1: ``jax.distributed`` and so gloo CPU collectives in every layout), simulated CPU devices.
    Inherited ``JAX_*`` coordinates, ``SLURM_*`` and ``OMPI_*`` variables are dropped (no cluster detection);
    ``STAPO_LAUNCHER_PID`` (this process) lets the process stop when the launcher dies (``runtime.stopping``).
    Takes int ids, a str-to-str environment. Never raises. Source: ``jax.distributed.initialize``'s
    ``JAX_*`` variables; XLA's ``--xla_force_host_platform_device_count``."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_", "OMPI_"))}
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i),
               STAPO_DISTRIBUTED="on", PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())})
    if devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


BAR_EVERY_S = 30.0  # how often a progress bar's state is written as a line where ``out`` is not a terminal


class _Console:
    """Writes the processes' output lines to ``out`` with their ``[p<i>]`` prefix, one writer at a time. A
    progress-bar refresh (text between ``\\r`` marks, as tqdm writes it) is redrawn in place on a terminal, and
    elsewhere (a log file, a pipe) kept back and written as a line at most every :data:`BAR_EVERY_S` seconds and
    when the bar ends: one progress bar per job, not one line per refresh."""

    def __init__(self, out):
        self.out, self.lock, self.bar_of = out, threading.Lock(), None
        try:
            self.tty = bool(out.isatty())
        except (AttributeError, ValueError):
            self.tty = False

    def write(self, i: int, text: str, bar: bool = False) -> None:
        with self.lock:
            if self.bar_of is not None:  # a bar is drawn: redraw over it (same process) or start below it
                self.out.write("\r" if self.bar_of == i else "\n")
            self.out.write(f"[p{i}] {text}" + ("" if bar else "\n"))
            self.bar_of = i if bar else None
            self.out.flush()

    def write_launcher(self, text: str) -> None:
        with self.lock:
            self.out.write(("\n" if self.bar_of is not None else "") + f"[launch] {text}\n")
            self.bar_of = None
            self.out.flush()


def _pump(i: int, stream, console: _Console) -> None:
    pending, last_line, buf = None, time.monotonic(), b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        buf += chunk
        while (cut := min((k for k in (buf.find(b"\n"), buf.find(b"\r")) if k >= 0), default=-1)) >= 0:
            seg, end, buf = buf[:cut].decode(errors="replace"), buf[cut:cut + 1], buf[cut + 1:]
            if end == b"\n":  # a line, or the last state of a bar
                console.write(i, seg or pending or "")
                pending = None
            elif seg and console.tty:
                console.write(i, seg, bar=True)
            elif seg and time.monotonic() - last_line >= BAR_EVERY_S:
                console.write(i, seg)
                last_line, pending = time.monotonic(), None
            elif seg:
                pending = seg
    if buf or pending:
        console.write(i, buf.decode(errors="replace") or pending)


def launch_local(n: int, argv: Sequence[str], *, devices: Optional[int] = None, kill_after_s: float = 30.0,
                 timeout_s: Optional[float] = None, out=None, module: Optional[str] = "stapo_jax") -> int:
    """Run ``python -m stapo_jax *argv`` as ``n`` JAX processes on this machine; returns the job's exit code.

    Args:
      n: process count (>= 1). argv: the ``stapo-jax`` command line of every process (e.g. ``["train",
        "--config", "configs/tiny_cpu.yaml"]``). devices: simulated CPU devices per process (None: unchanged).
      kill_after_s: grace period between SIGTERM and SIGKILL of the remaining processes after a failure.
      timeout_s: stop the whole job (exit code 124) after this many seconds; None waits as long as it runs.
      out: where prefixed lines go (default stdout); progress bars are redrawn in place on a terminal, else
        written as a line at most every :data:`BAR_EVERY_S` s and when they end.
      module: run ``python -m module *argv`` (default ``stapo_jax``); None runs ``python *argv``.
    A first SIGINT or SIGTERM to the launcher sends SIGTERM to every process (they checkpoint and stop, exit 0),
    a second sends SIGINT (they stop at once); each is one ``[launch]`` line.
    Returns:
      0 if every process exited 0, else the first non-zero exit code observed (124 on timeout, 130 after a
      second stop signal, 129 when the launcher's parent exited); a process ended by signal N gives 128 + N, as
      a shell reports it (SIGKILL: 137). The ``[launch]`` line names the process and how it ended.
    Raises:
      ValueError: ``n`` < 1 or an empty ``argv``.
    argv: str arguments; returns an int exit code.
    """
    if n < 1 or not argv:
        raise ValueError(f"launch: --local must be >= 1 (got {n}) and a command is required")
    console = _Console(out or sys.stdout)
    parent = os.getppid()  # when it changes, whoever started the launcher is gone (a killed pytest, a closed shell)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *(["-m", module] if module else []), *argv],
                              env=process_env(i, n, port, devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for i in range(n)]
    pumps = [threading.Thread(target=_pump, args=(i, p.stdout, console), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    signals = []

    def forward(signum, frame):  # 1st: every process checkpoints and stops; 2nd: every process stops at once
        signals.append(signal.Signals(signum).name)
        first = len(signals) == 1
        console.write_launcher(f"{signals[-1]}: " + ("asking every process to checkpoint and stop (SIGTERM); send it "
                                                     "again to stop them at once" if first else
                                                     "stopping every process now"))
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM if first else signal.SIGINT)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        rc = _watch(procs, console, kill_after_s, None if timeout_s is None else time.monotonic() + timeout_s, parent)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs, kill_after_s)
        for t in pumps:
            t.join(timeout=5)
    first_bad = next((c for c in (p.returncode for p in procs) if c != 0), 0)
    return rc or (EXIT_INTERRUPTED if len(signals) > 1 else shell_exit_code(first_bad))


def _watch(procs, console: "_Console", kill_after_s: float, deadline: Optional[float], parent: int) -> int:
    """Wait for the processes; on the first failure (or the deadline) say which process ended how, stop the
    others and return its exit code (124 on timeout); when the launcher's parent (pid ``parent``) is gone, stop
    every process and return :data:`EXIT_ORPHANED`; 0 once all ended without a failure seen."""
    while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
        if os.getppid() != parent:
            console.write_launcher(f"the launcher's parent (pid {parent}) is gone: stopping every process (SIGTERM, "
                                   f"SIGKILL after {kill_after_s:g} s)")
            _stop(procs, kill_after_s)
            return EXIT_ORPHANED
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed or (deadline is not None and time.monotonic() > deadline):
            rc = shell_exit_code(failed[0][1]) if failed else 124
            what = f"process {failed[0][0]} {exit_description(failed[0][1])}" if failed else "timeout"
            console.write_launcher(f"{what}: stopping the others (SIGTERM, SIGKILL after {kill_after_s:g} s)")
            _stop(procs, kill_after_s)
            return rc
        time.sleep(0.2)
    return 0


def exit_description(returncode: int) -> str:
    """How a child ended, in words: ``exited with 75 (the stall watchdog: resumable)``, ``was killed by SIGKILL
    (exit 137)``. Takes ``Popen.returncode`` (int); returns str; never raises. Source: POSIX exit status,
    ``sysexits.h``'s 75."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit {shell_exit_code(returncode)})"
    known = {75: "the stall watchdog: resumable", 130: "interrupted", 2: "bad input or config"}
    return f"exited with {returncode}" + (f" ({known[returncode]})" if returncode in known else "")


def shell_exit_code(returncode: int) -> int:
    """A child's ``Popen.returncode`` as a process exit status: ``-N`` (ended by signal N) becomes ``128 + N``,
    the shell's convention, so that it fits the launcher's own exit status (0..255); others unchanged. Int in,
    int out; never raises. Source: POSIX shells' ``$?`` for a signalled child."""
    return 128 - returncode if returncode < 0 else returncode


def _stop(procs, kill_after_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + kill_after_s
    for p in procs:
        try:
            p.wait(timeout=max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax launch --local N [--devices-per-process D] [--command train] [ARGS...]``.
    argv: str arguments; returns the int exit code. Raises: ValueError for ``--local`` or ``--devices-per-process``
    < 1; SystemExit(2) with one line for an option close to one of the launcher's own (a typo, difflib ratio >=
    0.8), which would otherwise reach the command."""
    p = argparse.ArgumentParser(prog="stapo-jax launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local", type=int, required=True, metavar="N", help="number of JAX processes on this machine")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="D",
                   help="simulated CPU devices per process (XLA_FLAGS=--xla_force_host_platform_device_count=D)")
    p.add_argument("--command", default="train", help="stapo-jax subcommand every process runs (default train)")
    p.add_argument("--kill-after", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL on failure")
    p.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds (exit 124)")
    a, rest = p.parse_known_args(argv)
    ours = ["--local", "--devices-per-process", "--command", "--kill-after", "--timeout", "--help"]
    for arg in rest:
        flag = arg.split("=", 1)[0]
        near = difflib.get_close_matches(flag, ours, n=1, cutoff=0.8) if flag.startswith("--") else []
        if near:
            p.error(f"unknown option {flag}: did you mean {near[0]}? (the options of `stapo-jax launch` come first; "
                    f"the rest goes to `stapo-jax {a.command}`)")
    if a.local < 1:
        raise ValueError(f"--local must be >= 1, got {a.local}")
    if a.devices_per_process is not None and a.devices_per_process < 1:
        raise ValueError(f"--devices-per-process must be >= 1, got {a.devices_per_process}")
    return launch_local(a.local, [a.command, *rest], devices=a.devices_per_process, kill_after_s=a.kill_after,
                        timeout_s=a.timeout)
