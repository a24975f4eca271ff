"""Compile every rollout program of a run before its first step (``trainer.precompile``).

The in-process sampler (``stapo_jax.rollout.driver.RolloutDriver``) meets a bounded set of programs, each
compiled on first use: one prefill per prefill bucket (``Qwen3Engine.prefill_bucket``), and per KV-cache length
``L`` of ``Qwen3Engine.kv_length_buckets``: the decode step (``multi_step`` of ``steps_per_sync`` steps, one per
sampling setting), the insert of a prefix of each prefill bucket <= ``L``, and the resize from ``L`` to every
other length (the driver grows the cache as slots lengthen and shrinks it as long ones finish). With ``P``
prefill buckets and ``K`` KV lengths that is at most ``P + K x (S + P + K - 1)`` programs (``S`` sampling
settings), each run once here on a state whose only occupied slot generates a single token, through the
engine's public methods, so the shapes, static arguments and shardings are the driver's own.
"""
from __future__ import annotations

from typing import Optional, Sequence

from stapo_jax.rollout.sampling import SamplingParams
from stapo_jax.runtime.watchdog import progress as mark_progress


def rollout_programs(engine, num_samplings: int) -> int:
    """Upper bound on the rollout programs :func:`precompile_rollout` compiles (the module docstring's
    ``P + K x (S + P + K - 1)``). ``engine``: a ``Qwen3Engine``; never raises. Source: this
    driver's program set (module docstring)."""
    p = len(prefill_buckets(engine))
    k = len(engine.kv_length_buckets)
    return p + k * (num_samplings + p + k - 1)


def prefill_buckets(engine) -> list[int]:
    """The prefill buckets a prompt of 1 .. ``max_prefill_length - 1`` tokens can fall in (ints, ascending).
    ``engine``: a ``Qwen3Engine``. Never raises. Source: ``Qwen3Engine.prefill_bucket`` (JetStream's
    padding buckets)."""
    out, n = set(), 1
    limit = engine.max_prefill_length - 1
    while n <= limit:
        b = engine.prefill_bucket(n)
        out.add(b)
        n = b + 1
    return sorted(out)


def precompile_rollout(rollout, samplings: Sequence[Optional[SamplingParams]], *, bar=None) -> int:
    """Run (so compile) every program of the bounded set in the module docstring on ``rollout``'s engine:
    ``rollout`` is a ``RolloutDriver`` or ``MultiHostRollout`` (anything with ``engine`` and a driver's
    ``steps_per_sync``); ``samplings``: the settings the run decodes with (None = the engine's own, as the RL
    steps use; ``SamplingParams(greedy=True)`` for held-out passes). ``bar``: a tqdm-like object whose
    ``update(1)`` is called per KV length. Returns the number of KV lengths warmed (an int). Raises what the engine
    raises (a bug: every call here is one the driver makes). Source: JetStream's warm-up of its prefill
    buckets and generate step (``engine.warmup``), extended to this driver's KV-cache buckets."""
    eng = rollout.engine
    driver = getattr(rollout, "driver", rollout)
    k = int(driver.steps_per_sync)
    params = eng.load_params()
    prefixes = [(b, eng.prefill_batch(params, [[1] * min(b, eng.max_prefill_length - 1)]))
                for b in prefill_buckets(eng)]
    lengths = eng.kv_length_buckets
    for L in lengths:
        state = eng.init_decode_state(0, length=L)
        for b, prefix in prefixes:
            if b <= L:
                state = eng.insert_sample(prefix, state, 0, 0, 1, 0)
        for sampling in samplings:
            state, _ = eng.step(params, state, sampling) if k == 1 else eng.multi_step(params, state, k, sampling)
        for other in lengths:
            if other != L:
                eng.resize_decode_state(eng.init_decode_state(0, length=L), other)
        del state
        if bar is not None:
            bar.update(1)
            mark_progress("precompile")  # each compiled program counts as progress for the stall watchdog
    return len(lengths)
