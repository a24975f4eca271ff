"""Compile accounting and the persistent compilation cache of a run.

Every XLA compile is counted and timed through JAX's own monitoring events (``jax.monitoring``), never by
reading logs:

- ``/jax/core/compile/backend_compile_duration`` (keyword ``fun_name``, e.g. ``jit(step)``): one per executable
  JAX builds (a new program, or a known program at a new input signature: shapes, dtypes, shardings, static
  arguments); it spans the persistent-cache lookup too.
- ``/jax/compilation_cache/cache_hits``: recorded inside that span when the executable came from the persistent
  cache; such an executable counts as a cache hit, not as a compile.
- ``/jax/core/compile/jaxpr_trace_duration`` and ``/jax/core/compile/jaxpr_to_mlir_module_duration`` (tracing and
  lowering, keyword ``fun_name``): added to the program's compile seconds. Tracing nests (a jitted function
  traced inside another records its own span inside the outer one): only outermost spans count, told apart by
  the start time JAX records as a scalar under the same event name when a span opens.

These event names are those of jax 0.10 - 0.12 (``jax/_src/dispatch.py``, ``jax/_src/compiler.py``). Compile seconds
are also charged to the current *phase* (``with stats.phase("update"):``) so the trainer can report step times
without them (``time/compile/<phase>``); the block's own compile seconds are on the object ``phase`` yields. Each
executable is also listed (:attr:`CompileStats.executables`) under that phase, or outside every phase under the
phase the stall watchdog last marked (``eval``, ``export``, ``checkpoint``; :func:`runtime.watchdog.current_phase`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import jax

from stapo_jax.runtime.watchdog import current_phase

log = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "stapo_jax", "jax_cache")
CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"  # JAX's own variable; ``auto`` reads it first


@dataclass
class ProgramStats:
    """One program (a jitted function's name): executables built, XLA compiles, persistent-cache hits, seconds."""

    n_shapes: int = 0      # executables built: compiles + cache hits (one per input signature of this name)
    n_compiles: int = 0    # XLA backend compiles (not served by the persistent cache)
    cache_hits: int = 0    # executables loaded from the persistent compilation cache
    compile_s: float = 0.0  # tracing + lowering + backend compile (or cache load) seconds


class PhaseCompile:
    """What :meth:`CompileStats.phase` yields: ``compile_s``, the seconds the starting thread waited on compiles
    charged to that phase inside the block (read live inside it, fixed when it ends; inner phases' excluded)."""

    def __init__(self, stats: "CompileStats", name: str):
        self._stats, self.name, self._start = stats, name, stats.phase_total(name)
        self._final: Optional[float] = None

    @property
    def compile_s(self) -> float:
        """Compile seconds of this block so far (float, seconds)."""
        if self._final is not None:
            return self._final
        return self._stats.phase_total(self.name) - self._start

    def end(self) -> None:
        """Fix :attr:`compile_s` (called when the block ends)."""
        self._final = self.compile_s


def program_name(fun_name: str) -> str:
    """``"jit(step)"`` -> ``"step"`` (JAX's ``fun_name`` keyword without its transform wrapper); other names
    unchanged. Takes and returns str; never raises. Source: the names JAX's ``log_compiles`` prints."""
    s = str(fun_name)
    while "(" in s and s.endswith(")"):
        s = s[s.index("(") + 1:-1]
    return s or str(fun_name)


class CompileStats:
    """Listens to JAX's compile events for its lifetime (``start`` .. ``close``, or a ``with`` block).

    ``take_step()`` returns what was compiled since the previous call (``perf/compiles``, ``perf/compile_s``,
    ``perf/cache_hits``, ``time/compile/<phase>``); ``table()`` the whole run per program (the ``compile`` key of
    ``summary.json``). Thread-safe (compiles may happen on worker threads; a hit is matched to the compile
    span of its own thread). Never raises from a listener.
    """

    def __init__(self):
        self.programs: dict[str, ProgramStats] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._phase = "other"
        self._step = {"compiles": 0, "cache_hits": 0, "compile_s": 0.0}
        self._step_phase: dict[str, float] = {}
        self._phase_total: dict[str, float] = {}  # the whole run's, never reset (PhaseCompile reads differences)
        self._started = False
        self._owner = threading.get_ident()  # the thread whose waits on compiles are taken out of step times
        self.steps_taken = 0  # take_step calls so far
        self.executables: list[tuple[int, str, str, bool]] = []  # (steps_taken, phase, program, cache hit)

    # --- listeners (called by jax.monitoring) ---
    def _on_event(self, event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT:
            self._local.hits = getattr(self._local, "hits", 0) + 1

    def _on_scalar(self, event: str, value: float, **kwargs) -> None:
        if event in TRACE_EVENTS:  # a span opens (LogElapsedTimeContextManager.__enter__)
            self._local.depth = getattr(self._local, "depth", 0) + 1

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT and event not in TRACE_EVENTS:
            return
        if event in TRACE_EVENTS:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = max(depth - 1, 0)
            if depth > 1:  # nested inside an outer trace, whose span already holds this time
                return
        name = program_name(kwargs.get("fun_name", "?"))
        # seconds the caller's thread waited on, outside any open trace span (whose own duration holds them):
        # only those leave the step's wall times (a background thread's compile, e.g. a checkpoint save's,
        # does not make the training thread wait)
        wall = threading.get_ident() == self._owner and getattr(self._local, "depth", 0) == 0
        with self._lock:
            p = self.programs.setdefault(name, ProgramStats())
            p.compile_s += float(duration)
            if wall:
                self._step["compile_s"] += float(duration)
                self._step_phase[self._phase] = self._step_phase.get(self._phase, 0.0) + float(duration)
                self._phase_total[self._phase] = self._phase_total.get(self._phase, 0.0) + float(duration)
            if event == BACKEND_COMPILE_EVENT:
                hit = getattr(self._local, "hits", 0) > 0
                self._local.hits = 0
                p.n_shapes += 1
                p.cache_hits += int(hit)
                p.n_compiles += int(not hit)
                self._step["cache_hits" if hit else "compiles"] += 1
                label = self._phase if self._phase != "other" else (current_phase() or "other")
                self.executables.append((self.steps_taken, label, name, hit))

    def start(self) -> "CompileStats":
        """Register the listeners (idempotent). Returns self."""
        if not self._started:
            self._owner = threading.get_ident()
            jax.monitoring.register_event_listener(self._on_event)
            jax.monitoring.register_event_duration_secs_listener(self._on_duration)
            if hasattr(jax.monitoring, "register_scalar_listener"):  # the span starts (nesting); older JAX lacks it
                jax.monitoring.register_scalar_listener(self._on_scalar)
            self._started = True
        return self

    def close(self) -> None:
        """Unregister the listeners (idempotent); the counts stay readable."""
        if self._started:
            jax.monitoring.unregister_event_listener(self._on_event)
            jax.monitoring.unregister_event_duration_listener(self._on_duration)
            if hasattr(jax.monitoring, "unregister_scalar_listener"):
                jax.monitoring.unregister_scalar_listener(self._on_scalar)
            self._started = False

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[PhaseCompile]:
        """Charge compile seconds inside the block to phase ``name`` (``rollout``, ``update``, ``sync``, ``eval``,
        ``precompile``); an inner phase takes over until it ends (the outer one is restored on exit). Yields a
        :class:`PhaseCompile` whose ``compile_s`` is the block's own compile seconds."""
        prev, self._phase = self._phase, name
        block = PhaseCompile(self, name)
        try:
            yield block
        finally:
            self._phase = prev
            block.end()

    def phase_total(self, name: str) -> float:
        """Compile seconds the starting thread waited on in phase ``name`` over the whole run (float, seconds)."""
        with self._lock:
            return self._phase_total.get(name, 0.0)

    def phase_seconds(self, name: str) -> float:
        """Compile seconds charged to phase ``name`` since the last :meth:`take_step` (float, seconds)."""
        with self._lock:
            return self._step_phase.get(name, 0.0)

    def take_step(self, count: bool = True) -> dict[str, float]:
        """Metrics of what was compiled since the previous call, then reset (``count``: advance
        ``steps_taken``, the step index of later :attr:`executables`): ``perf/compiles`` (XLA compiles),
        ``perf/cache_hits`` (persistent-cache loads), ``perf/compile_s`` (seconds the starting thread waited on
        compiles, all phases; compiles on other threads count in :meth:`table` only) and
        ``time/compile/<phase>`` (seconds) for every phase that compiled. Floats."""
        with self._lock:
            out = {"perf/compiles": float(self._step["compiles"]), "perf/cache_hits": float(self._step["cache_hits"]),
                   "perf/compile_s": float(self._step["compile_s"])}
            out.update({f"time/compile/{k}": v for k, v in sorted(self._step_phase.items())})
            self._step = {"compiles": 0, "cache_hits": 0, "compile_s": 0.0}
            self._step_phase = {}
            self.steps_taken += int(count)
        return out

    def totals(self) -> dict[str, float]:
        """Whole-run sums over programs: ``compiles``, ``cache_hits``, ``compile_s`` (seconds)."""
        with self._lock:
            ps = list(self.programs.values())
        return {"compiles": sum(p.n_compiles for p in ps), "cache_hits": sum(p.cache_hits for p in ps),
                "compile_s": sum(p.compile_s for p in ps)}

    def table(self, min_seconds: float = 0.0) -> list[dict]:
        """Programs of the run, slowest first: ``{"program", "n_shapes", "n_compiles", "compile_s",
        "cache_hits"}`` (the ``compile`` key of ``summary.json``); programs that built no executable and spent
        under ``min_seconds`` are left out. Never raises."""
        with self._lock:
            rows = [{"program": k, "n_shapes": p.n_shapes, "n_compiles": p.n_compiles,
                     "compile_s": round(p.compile_s, 4), "cache_hits": p.cache_hits}
                    for k, p in self.programs.items() if p.n_shapes or p.compile_s >= min_seconds]
        return sorted(rows, key=lambda r: -r["compile_s"])


def format_table(rows: list[dict], limit: int = 25) -> str:
    """The program table as aligned text lines for the log (``limit`` slowest programs, then a total line).
    Takes the rows of :meth:`CompileStats.table` (int / float / str values); returns str; never
    raises. Source: the ``compile`` key of ``summary.json`` (issue 33)."""
    head = f"{'program':32s} {'shapes':>6s} {'compiles':>8s} {'cache hits':>10s} {'seconds':>9s}"
    lines = [head] + [f"{r['program'][:32]:32s} {r['n_shapes']:6d} {r['n_compiles']:8d} {r['cache_hits']:10d} "
                      f"{r['compile_s']:9.2f}" for r in rows[:limit]]
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more programs")
    lines.append(f"{'total':32s} {sum(r['n_shapes'] for r in rows):6d} {sum(r['n_compiles'] for r in rows):8d} "
                 f"{sum(r['cache_hits'] for r in rows):10d} {sum(r['compile_s'] for r in rows):9.2f}")
    return "\n".join(lines)


def resolve_cache_dir(setting: Optional[str]) -> Optional[str]:
    """The persistent compilation cache directory of ``trainer.compilation_cache_dir``: ``auto`` =
    ``$JAX_COMPILATION_CACHE_DIR`` when set, else ``~/.cache/stapo_jax/jax_cache``; None or ``""`` = off (None);
    any other string is that path (``~`` expanded, made absolute). Takes and returns str / None;
    never raises. Source: JAX's ``JAX_COMPILATION_CACHE_DIR`` variable."""
    if setting is None or str(setting).strip() == "":
        return None
    if setting == "auto":
        setting = os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
    return os.path.abspath(os.path.expanduser(str(setting)))


def enable_compilation_cache(path: Optional[str]) -> Optional[str]:
    """Point JAX's persistent compilation cache at ``path`` (every process of a job given the same path shares
    it; None turns it off) with no minimum compile time or entry size, so that even the small programs of a
    CPU run are cached, and a second identical run or a resume loads every executable instead of compiling.
    Resets JAX's once-per-process cache decision, so it takes effect even after earlier compiles. Returns the
    path used (or None). Raises: OSError when the directory cannot be created (names it). Source: JAX's
    persistent compilation cache (``jax_compilation_cache_dir``, docs "Persistent compilation cache")."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    if path is not None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise OSError(f"trainer.compilation_cache_dir: cannot create {path}: {e}") from e
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_dir", path)
    cc.reset_cache()
    return path
