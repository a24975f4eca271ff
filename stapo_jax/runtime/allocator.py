"""The host memory allocator of a ``stapo-jax`` process: TCMalloc, preloaded by re-executing the process once.

Why: XLA:CPU allocates an executable's temporaries afresh on every call, and glibc's ``malloc`` serves blocks
above its mmap threshold (at most 32 MiB) with new mappings that it unmaps again on ``free``. Every call of a
big step therefore first-touches its temporaries page by page: one Qwen3-0.6B update on a 2-core Intel Xeon
took about 1,000,000 page faults (4 s of kernel time) per step. TCMalloc keeps freed memory for reuse, so the
same step took about 17,000 (``bench/bench_update.py --preset qwen3-0.6b``: 9.9 -> 6.0 s per update, and
torch's side 7.1 -> 5.2 s under the same allocator). PyTorch's CPU performance guide and Intel's launcher
(``ipexrun``) preload TCMalloc or jemalloc in the same way; an allocator can only be swapped before the process
starts (``LD_PRELOAD``), hence the re-execution.

``STAPO_JAX_ALLOCATOR`` chooses: ``auto`` (the default: TCMalloc when its library is installed, e.g. Debian's
``libtcmalloc-minimal4``, else the system allocator), ``tcmalloc`` (required: an error when it is missing) or
``system`` (no preload). A process that already runs under TCMalloc or jemalloc is left as it is, and
``STAPO_JAX_ALLOCATOR_REEXEC`` marks the one re-execution, so a preload that did not take effect is never
retried in a loop. Child processes (``stapo-jax launch``) inherit ``LD_PRELOAD``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

ENV_ALLOCATOR = "STAPO_JAX_ALLOCATOR"
ENV_REEXEC = "STAPO_JAX_ALLOCATOR_REEXEC"
MODES = ("auto", "tcmalloc", "system")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
# TCMalloc reports every allocation above 1 GiB on stderr by default; a 0.6B update allocates several
REPORT_THRESHOLD = ("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(1 << 40))


class AllocatorError(RuntimeError):
    """``STAPO_JAX_ALLOCATOR`` asks for an allocator this machine does not have, or holds an unknown value."""


def find_tcmalloc(dirs: Sequence[str] = LIBRARY_DIRS) -> Optional[str]:
    """Path of the first TCMalloc shared library (``TCMALLOC_NAMES``, the minimal build first) in ``dirs``,
    or None; a missing directory is skipped, not an error. Source: the Debian/Ubuntu (``libtcmalloc-minimal4``) and RHEL
    (``gperftools-libs``) install locations."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            path = Path(d) / name
            if path.is_file():
                return str(path)
    return None


def loaded_allocator(maps_path: str = "/proc/self/maps") -> str:
    """``"tcmalloc"``, ``"jemalloc"`` or ``"system"``: which allocator library is mapped into the process
    (read from ``maps_path``; ``"system"`` where it cannot be read, e.g. off Linux). A str path in,
    a str out. Never raises. Source: Linux ``/proc/<pid>/maps`` (the shared objects mapped into a process)."""
    try:
        maps = Path(maps_path).read_text()
    except OSError:
        return "system"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "system"


def allocator_mode(env: Mapping[str, str]) -> str:
    """The ``STAPO_JAX_ALLOCATOR`` value of ``env`` as given, ``"auto"`` where it is unset or empty. Takes
    a str mapping, returns a str; never raises (:func:`preload_env` rejects a value outside ``MODES``). Source:
    this module's ``STAPO_JAX_ALLOCATOR`` convention."""
    return env.get(ENV_ALLOCATOR) or "auto"


def preload_env(env: Mapping[str, str], loaded: str, library: Optional[str]) -> Optional[dict]:
    """The environment to re-execute the process with so that it runs under TCMalloc, or None to keep it.
    Str mappings and paths in, a dict of str (or None) out.

    Args:
      env: the current environment (``os.environ``); reads ``STAPO_JAX_ALLOCATOR``, ``STAPO_JAX_ALLOCATOR_REEXEC``
        and ``LD_PRELOAD``.
      loaded: :func:`loaded_allocator` of the process; library: :func:`find_tcmalloc`'s path or None.
    Returns:
      None for ``system``, for a process already under TCMalloc / jemalloc, after the one re-execution, and for
      ``auto`` without the library; else a copy of ``env`` with the library first in ``LD_PRELOAD``, the
      re-execution marker and TCMalloc's large-allocation report threshold (unless set) at 1 TiB.
    Raises:
      AllocatorError: ``STAPO_JAX_ALLOCATOR`` is not one of ``auto | tcmalloc | system``, or is ``tcmalloc`` and
        the library is missing (or the re-executed process still does not run under it).
    Source: PyTorch's CPU performance tuning guide (``LD_PRELOAD`` of TCMalloc / jemalloc).
    """
    mode = allocator_mode(env)
    if mode not in MODES:
        raise AllocatorError(f"{ENV_ALLOCATOR}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "system" or loaded != "system":
        return None
    if env.get(ENV_REEXEC):
        if mode == "tcmalloc":
            raise AllocatorError(f"{ENV_ALLOCATOR}=tcmalloc: {ENV_REEXEC} is set (this process was re-executed, or "
                                 f"inherited the variable) but TCMalloc is not loaded (LD_PRELOAD="
                                 f"{env.get('LD_PRELOAD', '')!r})")
        return None
    if library is None:
        if mode == "tcmalloc":
            raise AllocatorError(f"{ENV_ALLOCATOR}=tcmalloc: no {' or '.join(TCMALLOC_NAMES)} in "
                                 f"{', '.join(LIBRARY_DIRS)} (Debian/Ubuntu: apt-get install libtcmalloc-minimal4)")
        return None
    new = dict(env)
    new["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    new[ENV_REEXEC] = "1"
    new.setdefault(*REPORT_THRESHOLD)
    return new


def use_tcmalloc() -> str:
    """Re-execute this process under TCMalloc when :func:`preload_env` says so (``os.execve`` of
    ``sys.executable`` with ``sys.orig_argv``: the program starts again from the top with the same arguments);
    otherwise return the allocator it runs under (``"tcmalloc" | "jemalloc" | "system"``, a str).

    Call it first thing in a program's entry point, before work worth keeping: nothing of the current process
    survives the re-execution. A program read from standard input (``sys.argv[0]`` ``"-"`` or ``""``) is not
    re-executed. ``STAPO_JAX_ALLOCATOR_REEXEC`` is inherited by child processes (they keep ``LD_PRELOAD`` too).
    Raises AllocatorError as :func:`preload_env`; OSError when the interpreter cannot be executed. Source: as
    :func:`preload_env`.
    """
    loaded = loaded_allocator()
    env = preload_env(os.environ, loaded, find_tcmalloc())
    if env is None or not sys.executable or not getattr(sys, "orig_argv", None) or sys.argv[:1] in ([""], ["-"]):
        # nothing to do; an embedded interpreter that cannot be started again; or a program read from stdin,
        # which the first process has consumed (``python - < script.py`` would restart with nothing to run)
        return loaded
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    return loaded  # not reached
