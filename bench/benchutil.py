"""Shared timing helpers of the benchmarks in ``bench/`` (one definition): the machine line, interleaved
repeats of several sides, and the median with its spread.

Every bench prints :func:`machine_line` before and :func:`load_line` after its runs, times its sides with
:func:`interleaved` (a, b, a, b, ... so that load from other processes hits every side alike) and reports
:func:`summary` (median [min..max] of the repeats) and :func:`ratio` (of the medians).
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU model name from ``cpuinfo`` (Linux) with its family / model numbers and widest x86 vector
    extension, e.g. ``"AMD EPYC (family 25 model 1, avx2)"``: a VM may report only ``"AMD EPYC"`` for both a Zen 3
    (AVX2) and a Zen 4 (AVX-512) host, whose XLA:CPU matmul peaks differ by 2x. Else ``platform.processor()``,
    else ``"unknown"``."""
    from models.linear import cpuinfo_fields

    fields = cpuinfo_fields(cpuinfo)
    name = fields.get("model name")
    if not name:
        return platform.processor() or "unknown"
    flags = set(fields.get("flags", "").split())
    isa = next((f for f in ("avx512f", "avx2", "avx") if f in flags), None)
    extra = [f"family {fields['cpu family']} model {fields.get('model', '?')}"] if "cpu family" in fields else []
    extra += [isa] if isa else []
    return f"{name} ({', '.join(extra)})" if extra else name


def load_line(when: str = "now") -> str:
    """``"load average (1/5/15 min) <when>: a / b / c on N CPUs"``: a shared machine's load, printed before
    and after a bench so that a reader can judge the timings."""
    one, five, fifteen = os.getloadavg()
    return f"load average (1/5/15 min) {when}: {one:.2f} / {five:.2f} / {fifteen:.2f} on {os.cpu_count()} CPUs"


def use_cli_allocator() -> str:
    """Re-execute the bench under the host allocator the ``stapo-jax`` command uses (TCMalloc where it is
    installed, ``STAPO_JAX_ALLOCATOR``: ``stapo_jax.runtime.allocator.use_tcmalloc``), so that every side of a
    bench (torch's too: it is the same process) runs on the allocator a user's run has. Call it first in
    ``main``; returns the allocator name."""
    from stapo_jax.runtime.allocator import use_tcmalloc

    return use_tcmalloc()


def machine_line() -> str:
    """The machine (CPU model, core count, host allocator, JAX backend and first device, torch threads when
    torch is imported) and the load at start, one line."""
    import sys

    from stapo_jax.runtime.allocator import loaded_allocator

    parts = [f"CPU {cpu_model()} x {os.cpu_count()} cores", f"allocator {loaded_allocator()}"]
    if "jax" in sys.modules:
        jax = sys.modules["jax"]
        parts.append(f"jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind}, "
                     f"{jax.device_count()} device(s))")
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        parts.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    return "machine: " + "; ".join(parts) + "\n" + load_line("at start")


def interleaved(sides: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """Wall seconds of each side over ``repeats`` interleaved rounds (every side once per round, in order),
    after ``warmup`` untimed calls of each side. Each callable must block until its work is done
    (``jax.block_until_ready``, ``.item()``, ...). Returns ``{label: [seconds] * repeats}``; when ``cpu`` is a
    dict it is filled with the process CPU seconds (all threads) of the same calls, the steadier measure of work
    on a shared machine.

    Raises ``ValueError`` when ``repeats < 1`` or ``sides`` is empty."""
    if repeats < 1 or not sides:
        raise ValueError(f"interleaved: repeats must be >= 1 and sides non-empty (got repeats={repeats}, "
                         f"{len(sides)} sides)")
    for _ in range(warmup):
        for f in sides.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        for k, f in sides.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            times[k].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(k, []).append(time.process_time() - c0)
    return times


def scan_unroll_arg(text: str):
    """A ``--scan-unroll`` value as ``model.scan_unroll`` takes it: ``"auto"`` or an int (the bench exits with
    the flag named when it is neither)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"--scan-unroll must be 'auto' or an int >= 1, got {text!r}") from None


def median(ts: list[float]) -> float:
    """The median of ``ts`` (seconds)."""
    return statistics.median(ts)


def summary(ts: list[float], unit: str = "ms") -> str:
    """``"median [min..max] unit (n=k)"`` of a list of seconds, in ``ms`` or ``s``."""
    scale, digits = {"ms": (1e3, 1), "s": (1.0, 3)}[unit]
    return (f"{median(ts) * scale:.{digits}f} [{min(ts) * scale:.{digits}f}..{max(ts) * scale:.{digits}f}] {unit} "
            f"(median [min..max], n={len(ts)})")


def report_throughput(times: dict[str, list[float]], *, what: str, tokens: int, flops: float, peaks: dict[str, float],
                      width: int = 16, peak_word: str = "its", cpu: dict[str, list[float]] | None = None) -> None:
    """Print, for each side of :func:`interleaved`'s ``times``, the median time, tokens/s, GFLOP/s and the fraction
    of that side's matmul peak (``peaks[side]``, GFLOP/s), then each other side's paired ratio against ``"ours"``
    (and, with ``cpu``, the process CPU-seconds ratio). ``tokens`` per call, ``flops`` per call (model FLOPs)."""
    for k, ts in times.items():
        sec = median(ts)
        print(f"{k:{width}s} {what} {summary(ts, 's')}: {tokens / sec:7.1f} tok/s, {flops / sec / 1e9:6.1f} GFLOP/s "
              f"= {flops / sec / 1e9 / peaks[k] * 100:4.1f} % of {peak_word} matmul peak")
    for k in [k for k in times if k != "ours"]:
        extra = (f"; process CPU seconds (all threads) {k} / ours = {ratio(cpu[k], cpu['ours'])}"
                 if cpu is not None else "")
        print(f"ratio ours/{k} (tokens/s) = {ratio(times[k], times['ours'])} (median [per-round min..max]; "
              f"> 1: ours faster){extra}")


def ratio(a: list[float], b: list[float]) -> str:
    """``median(a) / median(b)`` with the spread of the per-round ratios, ``"r [lo..hi]"`` (the rounds are
    paired by :func:`interleaved`, so each round's ratio saw the same load)."""
    per_round = [x / y for x, y in zip(a, b)]
    return f"{median(a) / median(b):.2f} [{min(per_round):.2f}..{max(per_round):.2f}]"


def pick_torch_threads(fn: Callable[[], object], repeats: int = 2) -> int:
    """Set torch's intra-op threads to the faster of 1 and all cores for ``fn`` (best of ``repeats`` calls
    each) and return that count: on a shared, busy host OpenMP spin-waiting can make the multi-threaded run
    many times slower. Printed by the caller so that the reader knows which was used."""
    import torch

    best = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        fn()
        best[threads] = min(interleaved({"f": fn}, repeats, warmup=0)["f"])
    chosen = min(best, key=best.get)
    torch.set_num_threads(chosen)
    return chosen
