"""Bounded asynchronous dispatch: wait for the device after every :data:`DISPATCH_WINDOW` dispatched programs.

JAX dispatches device programs asynchronously; a loop that dispatches many without reading a result (one insert
per free decode slot, a prefill per few prompts) can have any number in flight. XLA:CPU admits at most 32
in-flight computations per device (``CpuClientOptions::max_inflight_computations_per_device``) and takes that
slot inside the per-device launch of a multi-device program; past 32 un-awaited programs whose collectives run
through gloo, one device's half of a program waits in the collective for the other's, which waits for a slot: a
deadlock (DESIGN.md "Multi-process runs"). Every rollout loop that dispatches programs without reading results
therefore counts them in a :class:`DispatchWindow`: the in-process :class:`~stapo_jax.rollout.driver.RolloutDriver`
refill loop, and :class:`~stapo_jax.rollout.engine.Qwen3Engine`'s JetStream methods (``prefill``, ``insert``,
``generate``), which JetStream's orchestrator threads call in a loop for ``stapo-jax serve``.

Source: the XLA:CPU in-flight limit above; the same bound as JAX's own advice to block periodically in long
asynchronous loops.
"""
from __future__ import annotations

import threading
from typing import Any

import jax

# Most device programs a loop dispatches before it waits for them (module docstring).
DISPATCH_WINDOW = 8


class DispatchWindow:
    """Counts device programs dispatched since the last wait and blocks when ``size`` are pending.

    Use :meth:`count` after dispatching programs, passing a result that depends on all of them (the decode state
    of a chain of inserts and steps, or the program's own output); :meth:`waited` when the host has read a result
    that did. Thread-safe (one window per dispatching loop; JetStream's prefill and generate threads each have
    their own). ``size`` >= 1, default :data:`DISPATCH_WINDOW`; raises ValueError otherwise.
    Source: module docstring.
    """

    def __init__(self, size: int = DISPATCH_WINDOW):
        if int(size) < 1:
            raise ValueError(f"dispatch window size={size} must be >= 1")
        self.size = int(size)
        self.unawaited = 0  # programs dispatched since the last wait
        self.n_waits = 0    # waits this window forced (a statistic)
        self._lock = threading.Lock()

    def count(self, result: Any, n: int = 1) -> Any:
        """Count ``n`` programs just dispatched; when ``size`` or more are un-awaited, block on ``result``
        (``jax.block_until_ready``, any pytree of arrays) and start counting again. Returns ``result``.
        Raises what ``jax.block_until_ready`` raises (a failed program). Source: module docstring."""
        with self._lock:
            self.unawaited += int(n)
            full = self.unawaited >= self.size
            if full:
                self.unawaited = 0
                self.n_waits += 1
        if full:
            result = jax.block_until_ready(result)
        return result

    def waited(self) -> None:
        """The host just read a result that depends on every counted program: nothing is in flight.
        Returns None; never raises. Source: module docstring."""
        with self._lock:
            self.unawaited = 0
