"""Multi-process JAX start-up: ``jax.distributed.initialize`` from flags or the environment, a no-op for a single
process. Call :func:`initialize` first thing in a program, before anything touches a JAX device.

Every process of a multi-host job runs the same program (TPU pod slices: one process per host; GPU clusters:
one per node or one per GPU). Where the job gets its coordinates, in order:

1. explicit arguments (``coordinator_address``, ``num_processes``, ``process_id``), or the environment
   variables ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
   ``JAX_PROCESS_ID`` (``JAX_LOCAL_DEVICE_IDS`` restricts a process to some local devices, e.g. one GPU);
2. otherwise, with ``mode="auto"``, a detected multi-process cluster: SLURM with more than one task
   (``SLURM_NTASKS`` > 1), Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1), or a multi-host Cloud TPU slice
   (``TPU_WORKER_HOSTNAMES`` lists more than one host). JAX's own cluster detection then fills in the
   coordinator, process count and id (``jax._src.clusters``: GCE metadata on TPU, ``SLURM_*`` variables);
3. otherwise a single process: nothing to initialise.

Timeouts (seconds, environment variables read by :func:`initialize`):

* ``STAPO_DISTRIBUTED_INIT_TIMEOUT_S`` (default 300): how long a process waits for the coordinator to accept a
  connection and for all processes to register (``jax.distributed.initialize(initialization_timeout=)``); a
  coordinator address nobody listens on gives :class:`DistributedError` after this long.
* ``STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S`` (default 100, raised for ``train`` above its stall limit): a process
  that stops answering (killed, crashed, hung) for this long makes every other process abort with JAX's "the JAX
  distributed service detected fatal errors ... another task died" (``heartbeat_timeout_seconds``); a run
  therefore never hangs on a dead peer for longer than about this bound. ``train`` asks for a heartbeat above its
  stall watchdog's limit (``min_heartbeat_s``), so that the watchdog of a process waiting on a stopped peer fires
  first: its line names the process, phase and step, with every thread's stack, and exits 75 (resumable).

``mode`` comes from the argument or ``STAPO_DISTRIBUTED`` (``auto`` default; ``on`` always calls
``jax.distributed.initialize()`` so JAX's detection decides, as on TPU pod slices where the launch script sets
it; ``off`` never does). Conventions follow ``jax.distributed.initialize`` and MaxText's
``maybe_initialize_jax_distributed_system``.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import socket
import time
import zlib
from typing import Optional, Sequence

import jax
import numpy as np

log = logging.getLogger(__name__)

__all__ = ["DistributedError", "DistributedInfo", "check_same_config", "detect_cluster", "initialize", "info"]
INIT_TIMEOUT_ENV = "STAPO_DISTRIBUTED_INIT_TIMEOUT_S"
HEARTBEAT_TIMEOUT_ENV = "STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S"

MODES = ("auto", "on", "off")


class DistributedError(ValueError):
    """Inconsistent distributed settings (names the argument or environment variable)."""


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """What this process sees after :func:`initialize`.

    Attributes:
      process_index, process_count: ``jax.process_index()`` / ``jax.process_count()``.
      local_device_count, device_count: devices of this process / of all processes.
      method: ``"single"`` (no initialisation), ``"explicit"`` (arguments / ``JAX_*`` variables), or the
        detected cluster (``"slurm"``, ``"ompi"``, ``"tpu"``, ``"forced"`` for ``mode="on"``).
      coordinator_address: the coordinator when known (explicit settings), else None.
    """

    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    method: str
    coordinator_address: Optional[str] = None

    @property
    def is_coordinator(self) -> bool:
        """True on process 0 (the one that writes logs, plots and exports)."""
        return self.process_index == 0


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise DistributedError(f"environment variable {name}={v!r} is not an integer") from None


def detect_cluster(environ: Optional[dict] = None) -> Optional[str]:
    """The multi-process cluster this process runs in, from environment variables alone.

    Returns:
      ``"slurm"`` (``SLURM_JOB_ID`` set and ``SLURM_NTASKS`` > 1), ``"ompi"`` (``OMPI_COMM_WORLD_SIZE`` > 1),
      ``"tpu"`` (``TPU_WORKER_HOSTNAMES`` with more than one host), or None (a single process): a str, no
      arrays. ``environ`` (default ``os.environ``): str -> str.
    Never raises (a non-integer count reads as 0) and touches no device. Source: the variables JAX's own
    cluster detection reads (``jax._src.clusters``: ``SlurmCluster``, ``OmpiCluster``, ``GceTpuCluster``).
    """
    env = os.environ if environ is None else environ

    def as_int(name):
        try:
            return int(env.get(name, "") or 0)
        except ValueError:
            return 0

    if "SLURM_JOB_ID" in env and as_int("SLURM_NTASKS") > 1:
        return "slurm"
    if as_int("OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return "tpu"
    return None


def info(method: str = "single", coordinator_address: Optional[str] = None) -> DistributedInfo:
    """The :class:`DistributedInfo` of the current JAX runtime (initialises the backend).

    ``method`` and ``coordinator_address`` (str, or None) are recorded as given; the counts are Python ints (no
    arrays). Raises what backend initialisation raises (e.g. ``RuntimeError`` for an unavailable
    ``JAX_PLATFORMS``). Source: ``jax.process_index`` / ``jax.process_count`` / ``jax.local_device_count`` /
    ``jax.device_count``."""
    return DistributedInfo(jax.process_index(), jax.process_count(), jax.local_device_count(),
                           jax.device_count(), method, coordinator_address)


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, local_device_ids: Optional[Sequence[int]] = None, *,
               mode: Optional[str] = None, initialization_timeout_s: Optional[int] = None,
               heartbeat_timeout_s: Optional[int] = None, min_heartbeat_s: Optional[int] = None) -> DistributedInfo:
    """Initialise multi-process JAX when the job has several processes; a no-op for one process.

    Takes str / int arguments only; the timeouts are int seconds. Source:
    ``jax.distributed.initialize`` (its ``initialization_timeout`` and ``heartbeat_timeout_seconds``) and
    MaxText's ``maybe_initialize_jax_distributed_system``.

    Args:
      coordinator_address: ``host:port`` of process 0 (default ``$JAX_COORDINATOR_ADDRESS``).
      num_processes: total processes (default ``$JAX_NUM_PROCESSES``).
      process_id: this process's index in ``[0, num_processes)`` (default ``$JAX_PROCESS_ID``).
      local_device_ids: local devices this process uses (default ``$JAX_LOCAL_DEVICE_IDS``, read by JAX).
      mode: ``auto`` | ``on`` | ``off`` (default ``$STAPO_DISTRIBUTED`` or ``auto``); see the module docstring.
      initialization_timeout_s: seconds to wait for the coordinator and all processes to connect (default
        ``$STAPO_DISTRIBUTED_INIT_TIMEOUT_S`` or 300).
      heartbeat_timeout_s: seconds without a heartbeat after which a peer counts as dead and every process
        aborts (default ``$STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S``, else the larger of 100 and
        ``min_heartbeat_s``: :func:`resolve_heartbeat`).
      min_heartbeat_s: the heartbeat the caller's stall watchdog needs (``runtime.watchdog.heartbeat_floor``), so
        a stall ends with the watchdog's stacks, not JAX's abort; an explicit heartbeat below it is kept, with a
        warning.
    Returns:
      :class:`DistributedInfo` (calling again after a successful initialisation returns the same state).
    Raises:
      DistributedError: an unknown mode, only some of the three explicit settings, ``num_processes`` < 1,
        ``process_id`` outside ``[0, num_processes)``, a non-integer environment value, or (process id > 0)
        a coordinator that accepts no connection within the initialization timeout. On process 0, JAX itself
        aborts the process (no Python exception) when a peer does not register within that timeout; the INFO
        line logged just before names the likely cause and the settings to check.
    """
    mode = mode or os.environ.get("STAPO_DISTRIBUTED", "auto") or "auto"
    if mode not in MODES:
        raise DistributedError(f"distributed mode {mode!r} (STAPO_DISTRIBUTED): expected one of {MODES}")
    addr = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    n = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
    init_s = initialization_timeout_s if initialization_timeout_s is not None else (
        _env_int(INIT_TIMEOUT_ENV) or 300)
    beat_s = resolve_heartbeat(heartbeat_timeout_s if heartbeat_timeout_s is not None else
                               _env_int(HEARTBEAT_TIMEOUT_ENV), min_heartbeat_s)
    timeouts = dict(initialization_timeout=int(init_s))
    if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
        timeouts["heartbeat_timeout_seconds"] = int(beat_s)
    if jax.distributed.is_initialized():
        return info("explicit" if addr else "already", addr)
    if mode == "off":
        return info("single")
    explicit = [x is not None for x in (addr, n, pid)]
    if any(explicit):
        if not all(explicit):
            missing = [name for name, given in zip(("coordinator_address (JAX_COORDINATOR_ADDRESS)",
                                                    "num_processes (JAX_NUM_PROCESSES)",
                                                    "process_id (JAX_PROCESS_ID)"), explicit) if not given]
            raise DistributedError(f"explicit distributed settings are incomplete: missing {missing}")
        if n < 1:
            raise DistributedError(f"num_processes={n} must be >= 1")
        if not 0 <= pid < n:
            raise DistributedError(f"process_id={pid} must lie in [0, num_processes={n})")
        if n == 1 and mode == "auto":
            return info("single")
        if ":" not in addr:
            raise DistributedError(f"coordinator_address={addr!r} must be host:port")
        log.info("jax.distributed.initialize(%s, num_processes=%d, process_id=%d)", addr, n, pid)
        if pid > 0:  # JAX aborts the process with a bare DEADLINE_EXCEEDED when nobody listens; say why first
            _wait_for_coordinator(addr, init_s)
        elif n > 1:  # the coordinator aborts too (a C++ check failure, no Python exception) when a peer never comes
            log.info("process 0 of %d: coordinator at %s, waiting up to %d s for all %d processes to register. If "
                     "this process then stops with 'DEADLINE_EXCEEDED' and 'RegisterTask', a process never "
                     "connected: start all %d with JAX_COORDINATOR_ADDRESS=%s and JAX_NUM_PROCESSES=%d (the other "
                     "JAX_PROCESS_IDs 1..%d), or raise %s", n, addr, int(init_s), n, n, addr, n, n - 1,
                     INIT_TIMEOUT_ENV)
        jax.distributed.initialize(addr, n, pid, local_device_ids=local_device_ids, **timeouts)
        return info("explicit", addr)
    cluster = detect_cluster() if mode == "auto" else "forced"
    if cluster is None:
        return info("single")
    log.info("jax.distributed.initialize() with JAX's cluster detection (%s)", cluster)
    jax.distributed.initialize(local_device_ids=local_device_ids, **timeouts)
    return info(cluster)


DEFAULT_HEARTBEAT_S = 100


def resolve_heartbeat(explicit: Optional[int], floor: Optional[int]) -> int:
    """The heartbeat timeout in seconds: ``explicit`` (the argument or ``$STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S``)
    when given, with a warning naming both values when it is below ``floor``; else the larger of
    :data:`DEFAULT_HEARTBEAT_S` and ``floor`` (the stall watchdog's need). Ints or None in, an int out; never
    raises. Source: issue 43 (JAX's heartbeat abort used to come before the watchdog's message)."""
    if explicit is None:
        return int(max(DEFAULT_HEARTBEAT_S, floor or 0))
    if floor and explicit < floor:
        log.warning("%s=%d is below the %d s the stall watchdog (trainer.stall_timeout_s) needs: a stalled peer "
                    "will end the job with JAX's heartbeat abort instead of the watchdog's stacks", HEARTBEAT_TIMEOUT_ENV,
                    explicit, floor)
    return int(explicit)


def _wait_for_coordinator(addr: str, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; DistributedError after ``timeout_s`` seconds."""
    host, _, port = addr.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        raise DistributedError(f"coordinator_address={addr!r} (JAX_COORDINATOR_ADDRESS): port {port!r} is not an "
                               f"integer") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), port_n), timeout=min(5.0, max(timeout_s, 0.1))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"no JAX coordinator accepts connections at {addr} (JAX_COORDINATOR_ADDRESS) after {timeout_s}s "
                    f"({INIT_TIMEOUT_ENV}): is process 0 running, and is the address/port right? ({e})") from None
            time.sleep(0.5)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_key_hashes(config_dict: dict) -> dict[str, int]:
    """``{dotted key: crc32 of repr(value)}`` (an int32 bit pattern) of a nested config dict.

    ``config_dict``: nested str-keyed dict (e.g. ``Config.to_dict()``); returns str -> Python int, one scalar per
    leaf key, sorted by key. Never raises for dicts of plain values (``repr`` of any value works).
    Source: ``zlib.crc32`` (the standard CRC-32), compared over processes by :func:`check_same_config`."""
    return {k: int(np.array(zlib.crc32(repr(v).encode()), np.uint32).view(np.int32))
            for k, v in sorted(_flat(config_dict).items())}


SAME_CONFIG_FIX = "start every process with the same --config and overrides"


def check_same_config(cfg, *, what: str = "config", fix: str = SAME_CONFIG_FIX) -> None:
    """All processes of the job run the same config: all-gather one hash per flattened key and compare.

    Args:
      cfg: a :class:`stapo_jax.config.schema.Config` (or any object with ``to_dict()``), or a nested dict (also
        of other values that must agree, e.g. the trainer's dataset fingerprints).
      what, fix: the error message's name for those values and its remedy.
    Gathers two int32 arrays: ``[2]`` (key count, crc32 of the key names) and ``[K]`` (one hash per key), as
    ``[P, 2]`` / ``[P, K]`` over the ``P`` processes; returns None. A collective: every process must call it.
    Source: ``jax.experimental.multihost_utils.process_allgather`` (as ``assert_equal`` there does for one
    value).
    Raises:
      DistributedError: the processes differ; the message names the keys (and which processes differ from 0).
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    hashes = config_key_hashes(cfg if isinstance(cfg, dict) else cfg.to_dict())
    keys = list(hashes)
    names = np.array([len(keys), zlib.crc32("\n".join(keys).encode()) & 0x7FFFFFFF], np.int32)
    all_names = np.asarray(multihost_utils.process_allgather(names))
    if (all_names != all_names[0]).any():
        raise DistributedError(f"the {jax.process_count()} processes were started with {what}s of different key "
                               f"sets (key counts {all_names[:, 0].tolist()}): {fix}")
    vals = np.array([hashes[k] for k in keys], np.int32)
    all_vals = np.asarray(multihost_utils.process_allgather(vals))  # [P, K]
    bad = np.nonzero((all_vals != all_vals[0]).any(0))[0]
    if bad.size:
        procs = sorted({int(p) for p in np.nonzero((all_vals != all_vals[0]).any(1))[0]})
        raise DistributedError(f"processes {procs} were started with a {what} that differs from process 0's in "
                               f"{[keys[i] for i in bad]}: {fix}")
