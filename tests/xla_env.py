"""XLA flags of the test processes: ``devices`` simulated CPU devices, and XLA:CPU's cheaper code generation.

The suite's programs are tiny and compile-bound (a full run compiles thousands of them), so the test processes,
and the ``stapo-jax`` children they start, ask LLVM for its unoptimized back end
(``--xla_backend_optimization_level=0``, ``--xla_llvm_disable_expensive_passes=true``): about a third less wall
time per compile-heavy file on the 2-core CI machine (tests/train/test_train_step.py: 131 s -> 88 s; the whole
suite: 26 min 40 s -> 20 min 36 s). They change how LLVM generates the machine code; every tolerance the tests
assert holds with them. The project's own commands (``make run``, ``stapo-jax launch``) keep XLA's default optimization.
"""
from __future__ import annotations

from typing import Optional

FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def xla_flags(devices: Optional[int] = None) -> str:
    """``XLA_FLAGS`` for a test process: the fast-compile flags, plus ``devices`` simulated CPU devices (None: the
    machine's one CPU device). A child process started with it does not get the user's own ``XLA_FLAGS`` (e.g.
    ``--xla_dump_to``); only the pytest processes do (:func:`with_test_flags`)."""
    flags = list(FAST_COMPILE_FLAGS)
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def with_test_flags(existing: str, devices: int) -> str:
    """``existing`` XLA flags (the user's ``XLA_FLAGS``) plus each flag of :func:`xla_flags` whose name they do not
    set: a user's own ``--xla_force_host_platform_device_count`` or optimization level wins."""
    flags = existing.split()
    names = {f.split("=", 1)[0] for f in flags}
    return " ".join(flags + [f for f in xla_flags(devices).split() if f.split("=", 1)[0] not in names])
