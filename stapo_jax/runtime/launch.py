"""``stapo-jax launch --local N``: rehearse a multi-host (TPU pod / SLURM) job on one machine.

Starts N copies of ``stapo-jax COMMAND ...`` (default ``train``) as the N JAX processes of one job: a free
127.0.0.1 port as ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=i``, and on CPU
``XLA_FLAGS=--xla_force_host_platform_device_count=D`` (``--devices-per-process``) so each process simulates
D devices. Every process of the job, a one-process job included, starts ``jax.distributed``
(``STAPO_DISTRIBUTED=on``): on CPU the cross-device collectives then run through gloo in every layout, so a
rehearsal as 1 process x 4 devices sums its gradients in the same order as 2 x 2 and 4 x 1 (XLA:CPU's
in-process all-reduce, used by a process without ``jax.distributed``, sums in another order; DESIGN.md,
"Multi-process runs"). Every output line is prefixed with ``[p<i>]``. When a process exits non-zero the others
get SIGTERM, then SIGKILL after ``--kill-after`` seconds; the launcher returns the first non-zero exit code (0
when all succeed). SIGINT/SIGTERM to the launcher are forwarded to every process (a simulated pod maintenance event).
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence


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
    Inherited ``JAX_*`` coordinates, ``SLURM_*`` and ``OMPI_*`` variables are dropped (no cluster detection).
    Takes int ids, a str-to-str environment. Never raises. Source: ``jax.distributed.initialize``'s
    ``JAX_*`` variables; XLA's ``--xla_force_host_platform_device_count``."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_", "OMPI_"))}
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i),
               STAPO_DISTRIBUTED="on", PYTHONUNBUFFERED="1")
    if devices:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return env


def _pump(i: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[p{i}] {line}" if line.endswith("\n") else f"[p{i}] {line}\n")
        out.flush()


def launch_local(n: int, argv: Sequence[str], *, devices: Optional[int] = None, kill_after_s: float = 30.0,
                 timeout_s: Optional[float] = None, out=None, module: Optional[str] = "stapo_jax") -> int:
    """Run ``python -m stapo_jax *argv`` as ``n`` JAX processes on this machine; returns the job's exit code.

    Args:
      n: process count (>= 1). argv: the ``stapo-jax`` command line of every process (e.g. ``["train",
        "--config", "configs/tiny_cpu.yaml"]``). devices: simulated CPU devices per process (None: unchanged).
      kill_after_s: grace period between SIGTERM and SIGKILL of the remaining processes after a failure.
      timeout_s: stop the whole job (exit code 124) after this many seconds; None waits as long as it runs.
      out: where prefixed lines go (default stdout).
      module: run ``python -m module *argv`` (default ``stapo_jax``); None runs ``python *argv``.
    Returns:
      0 if every process exited 0, else the first non-zero exit code observed (124 on timeout); a process
      ended by signal N gives 128 + N, as a shell reports it (SIGKILL: 137).
    Raises:
      ValueError: ``n`` < 1 or an empty ``argv``.
    argv: str arguments; returns an int exit code.
    """
    if n < 1 or not argv:
        raise ValueError(f"launch: --local must be >= 1 (got {n}) and a command is required")
    out = out or sys.stdout
    port = free_port()
    procs = []
    for i in range(n):
        cmd = [sys.executable, *(["-m", module] if module else []), *argv]
        p = subprocess.Popen(cmd, env=process_env(i, n, port, devices),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        procs.append(p)
    pumps = [threading.Thread(target=_pump, args=(i, p.stdout, out), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    rc, deadline = 0, None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while [p.poll() for p in procs].count(None):  # poll every process (any() would stop at the first)
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            timed_out = deadline is not None and time.monotonic() > deadline
            if failed or timed_out:
                rc = shell_exit_code(failed[0]) if failed else 124
                out.write(f"[launch] {'a process exited with ' + str(rc) if failed else 'timeout'}: stopping the "
                          f"others (SIGTERM, SIGKILL after {kill_after_s}s)\n")
                _stop(procs, kill_after_s)
                break
            time.sleep(0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _stop(procs, kill_after_s)
        for t in pumps:
            t.join(timeout=5)
    codes = [p.returncode for p in procs]
    first_bad = next((c for c in codes if c != 0), 0)
    return rc or shell_exit_code(first_bad)


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
    < 1."""
    p = argparse.ArgumentParser(prog="stapo-jax launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local", type=int, required=True, metavar="N", help="number of JAX processes on this machine")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="D",
                   help="simulated CPU devices per process (XLA_FLAGS=--xla_force_host_platform_device_count=D)")
    p.add_argument("--command", default="train", help="stapo-jax subcommand every process runs (default train)")
    p.add_argument("--kill-after", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL on failure")
    p.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds (exit 124)")
    a, rest = p.parse_known_args(argv)
    if a.local < 1:
        raise ValueError(f"--local must be >= 1, got {a.local}")
    if a.devices_per_process is not None and a.devices_per_process < 1:
        raise ValueError(f"--devices-per-process must be >= 1, got {a.devices_per_process}")
    return launch_local(a.local, [a.command, *rest], devices=a.devices_per_process, kill_after_s=a.kill_after,
                        timeout_s=a.timeout)
