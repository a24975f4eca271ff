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

``mode`` comes from the argument or ``STAPO_DISTRIBUTED`` (``auto`` default; ``on`` always calls
``jax.distributed.initialize()`` so JAX's detection decides, as on TPU pod slices where the launch script sets
it; ``off`` never does). Conventions follow ``jax.distributed.initialize`` and MaxText's
``maybe_initialize_jax_distributed_system``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional, Sequence

import jax

log = logging.getLogger(__name__)

__all__ = ["DistributedError", "DistributedInfo", "detect_cluster", "initialize", "info"]

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
      ``"tpu"`` (``TPU_WORKER_HOSTNAMES`` with more than one host), or None (a single process).
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
    """The :class:`DistributedInfo` of the current JAX runtime (initialises the backend)."""
    return DistributedInfo(jax.process_index(), jax.process_count(), jax.local_device_count(),
                           jax.device_count(), method, coordinator_address)


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, local_device_ids: Optional[Sequence[int]] = None, *,
               mode: Optional[str] = None, initialization_timeout_s: int = 300) -> DistributedInfo:
    """Initialise multi-process JAX when the job has several processes; a no-op for one process.

    Args:
      coordinator_address: ``host:port`` of process 0 (default ``$JAX_COORDINATOR_ADDRESS``).
      num_processes: total processes (default ``$JAX_NUM_PROCESSES``).
      process_id: this process's index in ``[0, num_processes)`` (default ``$JAX_PROCESS_ID``).
      local_device_ids: local devices this process uses (default ``$JAX_LOCAL_DEVICE_IDS``, read by JAX).
      mode: ``auto`` | ``on`` | ``off`` (default ``$STAPO_DISTRIBUTED`` or ``auto``); see the module docstring.
      initialization_timeout_s: seconds to wait for all processes to connect.
    Returns:
      :class:`DistributedInfo` (calling again after a successful initialisation returns the same state).
    Raises:
      DistributedError: an unknown mode, only some of the three explicit settings, ``num_processes`` < 1,
        ``process_id`` outside ``[0, num_processes)``, or a non-integer environment value.
    """
    mode = mode or os.environ.get("STAPO_DISTRIBUTED", "auto") or "auto"
    if mode not in MODES:
        raise DistributedError(f"distributed mode {mode!r} (STAPO_DISTRIBUTED): expected one of {MODES}")
    addr = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    n = num_processes if num_processes is not None else _env_int("JAX_NUM_PROCESSES")
    pid = process_id if process_id is not None else _env_int("JAX_PROCESS_ID")
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
        jax.distributed.initialize(addr, n, pid, local_device_ids=local_device_ids,
                                   initialization_timeout=initialization_timeout_s)
        return info("explicit", addr)
    cluster = detect_cluster() if mode == "auto" else "forced"
    if cluster is None:
        return info("single")
    log.info("jax.distributed.initialize() with JAX's cluster detection (%s)", cluster)
    jax.distributed.initialize(local_device_ids=local_device_ids, initialization_timeout=initialization_timeout_s)
    return info(cluster)
