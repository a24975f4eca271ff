"""Steady-state throughput of an RL run, apart from its warm-up.

Warm-up = everything before the run's first RL step ends (model build, ``trainer.precompile``, the held-out
pass, RL step 1 of this process, resumed or not). The steady state is every later step that compiled nothing
(``perf/compile_s`` 0: a step with a recompile is left out, and counted); its figures come from the per-step
metrics the trainer logs (compile seconds already taken out of ``time/*``):

- ``median_step_s``: median ``time/step``;
- ``rollout_tokens_per_s``: generated (response) tokens / ``time/rollout``, summed over the steps;
- ``update_tokens_per_s``: real (unpadded) tokens / ``time/update`` summed;
- ``mfu``: model FLOPs of the update (``perf/update_flops``) / ``time/update`` / (chip peak x devices).
"""
from __future__ import annotations

import statistics
from typing import Optional

import numpy as np

from models.flops import sequence_forward_flops

STEADY_KEYS = ("steps", "median_step_s", "rollout_tokens_per_s", "update_tokens_per_s", "mfu", "peak_flops",
               "chip")


def update_work(qcfg, attention_mask: np.ndarray, response_length: int, ppo_epochs: int = 1) -> dict[str, float]:
    """Per-step work of an update over a rollout batch: ``perf/update_tokens`` (real tokens), ``perf/
    response_tokens`` (generated tokens) and ``perf/update_flops``: model FLOPs = one forward per sequence for the
    old-log-prob pass + ``ppo_epochs`` x (forward + backward = 3 forwards), each forward
    ``models.flops.sequence_forward_flops`` at the sequence's real length (no remat recompute, no padding: MFU's
    model FLOPs).

    Args: qcfg: the model's Qwen3 config; attention_mask [B, P + R] (numpy, bool or 0/1); response_length: R;
    ppo_epochs: passes per step. Returns floats. Raises: ValueError for a mask that is not 2-D.
    Source: PaLM's MFU (Chowdhery et al. 2022, appendix B: model FLOPs without rematerialisation)."""
    mask = np.asarray(attention_mask).astype(bool)
    if mask.ndim != 2:
        raise ValueError(f"attention_mask must be [B, P + R], got shape {mask.shape}")
    tokens = mask.sum(1).astype(np.float64)
    responses = mask[:, mask.shape[1] - int(response_length):].sum(1).astype(np.float64)
    fwd = float(np.sum(sequence_forward_flops(qcfg, tokens, responses)))
    return {"perf/update_tokens": float(tokens.sum()), "perf/response_tokens": float(responses.sum()),
            "perf/update_flops": fwd * (1 + 3 * int(ppo_epochs))}


def steady_state(rows: list[dict], first_step: int, peak: Optional[dict]) -> dict:
    """The ``steady_state`` summary over ``rows`` (metric dicts with ``"step"``) whose step is after
    ``first_step`` (the warm-up step of this process) and that compiled nothing (``perf/compile_s`` 0 or absent):
    ``{"steps", "median_step_s", "rollout_tokens_per_s", "update_tokens_per_s", "mfu", "peak_flops", "chip"}``
    (+ ``"devices"``, ``"steps_with_compile"``: the later steps left out because they compiled), the figures None
    without steady steps or without the metrics they need. ``peak``: ``chips.device_peak`` output (or None).
    Float / int / str values. Never raises. Source: the trainer's metrics (``time/*``, ``perf/*``)."""
    later = [r for r in rows if r.get("step", 0) > first_step]
    steady = [r for r in later if not r.get("perf/compile_s")]
    out: dict = {"steps": len(steady), "steps_with_compile": len(later) - len(steady), "median_step_s": None,
                 "rollout_tokens_per_s": None,
                 "update_tokens_per_s": None, "mfu": None,
                 "peak_flops": None if peak is None else peak["peak_flops"],
                 "chip": None if peak is None else peak["chip"],
                 "devices": None if peak is None else peak["devices"]}

    def total(key):
        vals = [r.get(key) for r in steady]
        return None if not vals or any(v is None for v in vals) else float(sum(vals))

    if steady and all(r.get("time/step") is not None for r in steady):
        out["median_step_s"] = float(statistics.median(r["time/step"] for r in steady))
    t_roll, t_upd = total("time/rollout"), total("time/update")
    resp, upd, flops = total("perf/response_tokens"), total("perf/update_tokens"), total("perf/update_flops")
    if t_roll and resp is not None:
        out["rollout_tokens_per_s"] = resp / t_roll
    if t_upd and upd is not None:
        out["update_tokens_per_s"] = upd / t_upd
    if t_upd and flops is not None and peak is not None and peak["peak_flops"]:
        out["mfu"] = flops / t_upd / (peak["peak_flops"] * peak["devices"])
    return out


def format_steady_state(s: dict) -> str:
    """One log line of :func:`steady_state`'s dict (float / int / str values in, str out): the steps it covers,
    the steps left out for a compile, then the figures. Never raises. Source: the ``steady_state`` key of
    ``summary.json`` (issue 33, issue 43)."""
    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)
    n_left = s.get("steps_with_compile") or 0
    left = f" ({n_left} step{'s' if n_left != 1 else ''} with a compile left out)" if n_left else ""
    return (f"steady state over {s['steps']} step{'s' if s['steps'] != 1 else ''} after warm-up{left}: "
            f"median step {num(s['median_step_s'], '.3f')} s, "
            f"rollout {num(s['rollout_tokens_per_s'], ',.0f')} tok/s, update {num(s['update_tokens_per_s'], ',.0f')} "
            f"tok/s, MFU {num(None if s['mfu'] is None else 100 * s['mfu'], '.2f')} % of "
            f"{num(None if s['peak_flops'] is None else s['peak_flops'] / 1e12, '.3g')} TFLOP/s x {s['devices']} "
            f"({s['chip']})")


def compiles_after_warmup(executables: list, steps_taken: int, first_step: int) -> list[dict]:
    """Every XLA compile after the warm-up, labelled by when it happened: ``{"step", "phase", "program", "when"}``.
    ``executables``: ``CompileStats.executables`` (``(steps counted before it, phase, program, cache hit)``);
    ``steps_taken``: the RL steps counted in all (``CompileStats.steps_taken``); ``first_step``: the warm-up step.
    A compile during RL step s has ``step`` s and ``when`` ``"step s"``; one after the last step's metrics (the
    held-out pass and HF export after RL, the last checkpoint) has ``step`` None and ``when`` ``"after RL"``.
    Cache hits and warm-up compiles are left out. Int / str values. Never raises. Source: issue 33's
    end-of-run report."""
    out = []
    for n, phase, name, hit in executables:
        if n < 1 or hit:
            continue
        after = n >= steps_taken
        step = None if after else first_step + n
        out.append({"step": step, "phase": phase, "program": name, "when": "after RL" if after else f"step {step}"})
    return out


def run_report(stats, rows: list[dict], first_step: int, dtype: str, write=print) -> dict:
    """The end-of-run ``compile`` table (``stats``: a ``runtime.compile_stats.CompileStats``) and
    ``steady_state`` figures (:func:`steady_state` over ``rows`` after ``first_step``, the chip peak of
    ``runtime.chips.device_peak`` at compute ``dtype``), each also written as lines with ``write``.
    Also lists every XLA compile after the warm-up (``compile_after_warmup``, :func:`compiles_after_warmup`: by RL
    step, or ``after RL`` with its phase, e.g. ``eval`` or ``export``).
    Returns ``{"compile": [...], "compile_after_warmup": [...], "steady_state": {...}}`` (JSON-able). Never raises
    for well-formed rows. Source: issue 33's end-of-run report."""
    from stapo_jax.runtime.chips import device_peak
    from stapo_jax.runtime.compile_stats import format_table

    table = stats.table(min_seconds=0.01)  # taken before device_peak, whose CPU measurement compiles a matmul
    totals = stats.totals()
    write(f"compiled programs ({totals['compiles']} compiles, {totals['cache_hits']} persistent-cache hits, "
          f"{totals['compile_s']:.1f} s):\n" + format_table(table))
    late = compiles_after_warmup(stats.executables, stats.steps_taken, first_step)
    if late:
        write(f"compiled after the warm-up (which ended with RL step {first_step}): {format_late_compiles(late)}")
    steady = steady_state(rows, first_step, device_peak(dtype))
    if steady["steps"]:  # a run with no steady step (e.g. a resume that ran one step) prints no line
        write(format_steady_state(steady))
    return {"compile": table, "compile_after_warmup": late, "steady_state": steady}


def format_late_compiles(late: list[dict]) -> str:
    """:func:`compiles_after_warmup`'s entries grouped by program, in order of first appearance: ``program xN
    (when: phase, ...)`` with the count when above 1 and each distinct ``when: phase`` once, e.g. ``slice x12
    (step 22: update)``. Takes dicts of int / str; returns str; never raises. Source: issue 43 (one line per
    program, not one entry per compile)."""
    groups: dict[str, list] = {}
    for e in late:
        groups.setdefault(e["program"], []).append(f"{e['when']}: {e['phase']}")
    parts = []
    for program, whens in groups.items():
        count = f" x{len(whens)}" if len(whens) > 1 else ""
        parts.append(f"{program}{count} ({', '.join(dict.fromkeys(whens))})")
    return ", ".join(parts)
