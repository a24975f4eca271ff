"""Issue 33: compile accounting through JAX's monitoring events, a bounded set of shapes compiled during the
warm-up (``trainer.precompile``), the persistent compilation cache, and the steady-state summary.

The end-to-end runs: 12 RL steps of the tiny trainer config at T = 1 (responses end at different lengths) with
``trainer.precompile=true``; then the same run again in a new folder, and a resume of the first, both against the
first run's persistent cache.
"""
from __future__ import annotations

import json
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fixtures_trainer import metric_rows, run_cli, write_config
from stapo_jax.runtime.chips import chip_peak
from stapo_jax.runtime.compile_stats import (BACKEND_COMPILE_EVENT, CompileStats, enable_compilation_cache, program_name,
                                             resolve_cache_dir)
from stapo_jax.train.packing import fit_geometry, fixed_geometries
from stapo_jax.train.steady_state import steady_state


def test_program_name_strips_transform_wrappers():
    assert program_name("jit(step)") == "step"
    assert program_name("pmap(jit(fn))") == "fn"
    assert program_name("step_jit") == "step_jit"


def test_compiles_and_persistent_cache_hits_are_counted(tmp_path, monkeypatch):
    import jax.experimental.compilation_cache.compilation_cache as cc

    before = jax.config.jax_compilation_cache_dir
    try:
        enable_compilation_cache(str(tmp_path / "cache"))
        with CompileStats() as stats:
            f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)
            x3, x5 = jnp.ones(3), jnp.ones(5)  # made before the counted calls (array constructors compile too)
            stats.take_step()
            f(x3).block_until_ready()
            f(x5).block_until_ready()
            f(x5).block_until_ready()  # in memory: no new executable
            first = stats.take_step()
            jax.clear_caches()  # forget the in-memory executables: the next calls read the persistent cache
            f(x3).block_until_ready()
            second = stats.take_step()
        assert first["perf/compiles"] == 2 and first["perf/cache_hits"] == 0
        assert second["perf/compiles"] == 0 and second["perf/cache_hits"] == 1
        row = next(r for r in stats.table() if r["program"] == "<lambda>")
        assert (row["n_shapes"], row["n_compiles"], row["cache_hits"]) == (3, 2, 1)
        assert row["compile_s"] > 0
    finally:
        enable_compilation_cache(before)
        cc.reset_cache()


def _program(name: str, scale: float):
    """A jitted ``x * scale`` named ``name``; a new ``scale`` is a new program (no persistent-cache hit)."""
    def fn(x):
        return x * scale
    fn.__name__ = name
    return jax.jit(fn)


def test_compiles_after_the_rl_loop_are_labelled_by_what_they_are(monkeypatch):
    """A compile in RL step 2 is listed as step 2; the held-out pass and the HF export after the last step as
    "after RL" with the phase the trainer marks on the watchdog (eval, export), not as step 3 of a 2-step run."""
    import time

    from stapo_jax.runtime import chips
    from stapo_jax.runtime.watchdog import StallWatchdog, progress
    from stapo_jax.train.steady_state import run_report

    monkeypatch.setattr(chips, "device_peak", lambda dtype: None)  # no CPU matmul measurement
    salt = float(time.time_ns() % 1_000_003)
    x = jnp.ones(3)
    with StallWatchdog(0), CompileStats() as stats:
        stats.take_step(count=False)
        _program("warmup_prog", salt)(x).block_until_ready()  # RL step 1: the warm-up
        stats.take_step()
        with stats.phase("rollout"):
            _program("step2_prog", salt + 1)(x).block_until_ready()
        stats.take_step()
        progress("eval")
        _program("heldout_prog", salt + 2)(x).block_until_ready()
        progress("export")
        _program("export_prog", salt + 3)(x).block_until_ready()
        lines = []
        report = run_report(stats, [{"step": 1}, {"step": 2}], 1, "float32", write=lines.append)
    late = [e for e in report["compile_after_warmup"] if e["program"].endswith("_prog")]
    assert late == [
        {"step": 2, "phase": "rollout", "program": "step2_prog", "when": "step 2"},
        {"step": None, "phase": "eval", "program": "heldout_prog", "when": "after RL"},
        {"step": None, "phase": "export", "program": "export_prog", "when": "after RL"}]
    printed = next(line for line in lines if line.startswith("compiled after the warm-up (which ended with RL step 1): "))
    assert ("step2_prog (step 2: rollout)" in printed and "heldout_prog (after RL: eval)" in printed
            and "export_prog (after RL: export)" in printed and "step 3" not in printed)


def test_cache_dir_setting(monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/tmp/somewhere")
    assert resolve_cache_dir("auto") == "/tmp/somewhere"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert resolve_cache_dir("auto").endswith(".cache/stapo_jax/jax_cache")
    assert resolve_cache_dir(None) is None and resolve_cache_dir("") is None


def test_fixed_geometries_bound_the_packed_shapes():
    assert fixed_geometries(8, 48, long_rows=False) == [(2, 48), (4, 48), (8, 48)]
    assert fixed_geometries(8, 48, long_rows=True) == [(1, 96), (1, 192), (1, 384)]
    geos = fixed_geometries(8, 48, long_rows=False)
    # 8 sequences of 10 tokens: 4 per 48-token row -> 2 rows
    assert fit_geometry([np.full(8, 10)], geos) == (2, 48)
    assert fit_geometry([np.full(8, 30)], geos) == (8, 48)  # one per row
    assert fit_geometry([np.array([30, 30, 30, 5, 5])], geos) == (4, 48)
    with pytest.raises(ValueError, match="no packed geometry"):
        fit_geometry([np.full(9, 47)], geos)


def test_chip_table_and_steady_state_figures():
    assert chip_peak("NVIDIA H200", "bfloat16") == ("NVIDIA H200", 989.4e12)
    assert chip_peak("NVIDIA H100 80GB HBM3", "float32") == ("NVIDIA H100", 494.7e12)
    assert chip_peak("TPU v5 lite", "bfloat16") == ("TPU v5e", 197e12)
    assert chip_peak("TPU v4", "float32") == ("TPU v4", 275e12)
    assert chip_peak("cpu", "float32") is None
    rows = [{"step": s, "time/step": t, "time/rollout": 1.0, "time/update": 2.0, "perf/response_tokens": 100.0,
             "perf/update_tokens": 400.0, "perf/update_flops": 8e12, "perf/compile_s": 0.0}
            for s, t in ((1, 50.0), (2, 3.0), (3, 5.0), (4, 4.0))]
    s = steady_state(rows, 1, {"chip": "X", "peak_flops": 1e13, "devices": 2})
    assert s["steps"] == 3 and s["median_step_s"] == 4.0
    assert s["rollout_tokens_per_s"] == 100.0 and s["update_tokens_per_s"] == 200.0
    assert s["mfu"] == pytest.approx(8e12 * 3 / 6.0 / 2e13)
    assert steady_state(rows[:1], 1, None)["median_step_s"] is None


def test_steady_state_leaves_out_steps_that_compiled_and_runs_without_steady_steps():
    """Issue 43: a recompile in step 3 (9.4 s) was inside the steady-state line ("compile in them 9.40 s"), and a
    resumed run with one step printed ``n/a`` figures. Now step 3 is left out and counted, and a run with no steady
    step prints no line."""
    from stapo_jax.train.steady_state import format_steady_state, run_report

    rows = [{"step": s, "time/step": t, "time/rollout": 1.0, "time/update": 2.0, "perf/response_tokens": 100.0,
             "perf/update_tokens": 400.0, "perf/update_flops": 8e12, "perf/compile_s": c}
            for s, t, c in ((1, 50.0, 40.0), (2, 3.0, 0.0), (3, 9.0, 9.4), (4, 4.0, 0.0), (5, 5.0, 0.0))]
    s = steady_state(rows, 1, None)
    assert (s["steps"], s["steps_with_compile"], s["median_step_s"]) == (3, 1, 4.0)
    assert s["update_tokens_per_s"] == 1200.0 / 6.0
    line = format_steady_state(s)
    assert line.startswith("steady state over 3 steps after warm-up (1 step with a compile left out): median "
                           "step 4.000 s,") and "compile in them" not in line
    stats = CompileStats()
    lines = []
    run_report(stats, rows[:1], 1, "float32", write=lines.append)  # a resume that ran its warm-up step only
    assert lines and not [x for x in lines if "steady state" in x], lines


def test_recompiles_after_the_warm_up_are_grouped_by_program():
    from stapo_jax.train.steady_state import format_late_compiles

    late = ([{"step": 22, "phase": "update", "program": "slice", "when": "step 22"}] * 12
            + [{"step": 22, "phase": "update", "program": "gather", "when": "step 22"},
               {"step": 30, "phase": "update", "program": "gather", "when": "step 30"},
               {"step": None, "phase": "eval", "program": "step_jit", "when": "after RL"}])
    assert format_late_compiles(late) == ("slice x12 (step 22: update), gather x2 (step 22: update, step 30: "
                                          "update), step_jit (after RL: eval)")


def _probe_compile() -> None:
    """One backend-compile event through JAX's public monitoring API, as JAX records it for a program ``probe``."""
    jax.monitoring.record_event_duration_secs(BACKEND_COMPILE_EVENT, 0.25, fun_name="jit(probe)")


@pytest.mark.parametrize("fail_at", ["mesh", "logger"])
def test_a_setup_failure_releases_the_compile_listener_and_what_else_it_opened(tmp_path, monkeypatch, fail_at):
    """Issue 33: ``train`` raising during its setup, after the compile listener started (an impossible mesh; or a
    metrics logger that cannot be made, after the reward pool and checkpointer exist), leaves no listener
    registered and closes the scorer and checkpointer it had opened; the SIGTERM handler is the one before."""
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.train import run_setup, trainer

    made, closed = [], []

    class Recording(CompileStats):
        def start(self):
            made.append(self)
            return super().start()

    real_scorer, real_close = run_setup.make_scorer, run_setup.Checkpointer.close

    def recording_scorer(*args, **kwargs):
        scorer = real_scorer(*args, **kwargs)
        close = scorer.close
        scorer.close = lambda: (closed.append("scorer"), close())[1]
        return scorer

    def refuse(*args, **kwargs):
        raise RuntimeError("no logger today")

    monkeypatch.setattr(run_setup, "CompileStats", Recording)
    monkeypatch.setattr(run_setup, "make_scorer", recording_scorer)
    monkeypatch.setattr(run_setup.Checkpointer, "close", lambda self: (closed.append("ckpt"), real_close(self))[1])
    monkeypatch.setattr(run_setup.MetricsLogger, "from_config", refuse)
    handler = signal.getsignal(signal.SIGTERM)
    over = ["mesh.data=3"] if fail_at == "mesh" else []
    cfg = load_config("configs/tiny_cpu.yaml", [f"trainer.run_dir={tmp_path / 'run'}", "sft.steps=0", "data.gym.size=16",
                                                "data.gym.val_size=0", "trainer.total_steps=1", *over])
    with pytest.raises(ConfigError if fail_at == "mesh" else RuntimeError, match="mesh.data=3|no logger today"):
        trainer.train(cfg)
    assert len(made) == 1
    _probe_compile()
    assert "probe" not in made[0].programs  # its listeners are gone
    assert closed == ([] if fail_at == "mesh" else ["ckpt", "scorer"])  # the ExitStack closes in reverse order
    assert signal.getsignal(signal.SIGTERM) is handler
    with Recording() as control:  # the probe reaches a listening CompileStats (so the check above can fail)
        _probe_compile()
    assert control.programs["probe"].n_shapes == 1


RUN_OVERRIDES = dict(sft={"steps": 0},
                     model={"use_remove_padding": False},
                     rollout={"n": 4, "temperature": 1.0, "max_new_tokens": 16, "max_concurrent_decodes": 16},
                     trainer={"total_steps": 12, "save_every": 0, "export_hf": False, "logger": [],
                              "precompile": True})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 12-step run, the same run again in another folder, and a resume of the first by one step; all three
    share one fresh persistent cache."""
    base = tmp_path_factory.mktemp("compile")
    cache = base / "jax_cache"
    out = {}
    for name, run, extra in (("first", "run", {}), ("second", "run_again", {}),
                             ("resumed", "run", {"total_steps": 13})):
        over = {**RUN_OVERRIDES, "trainer": {**RUN_OVERRIDES["trainer"], "compilation_cache_dir": str(cache),
                                             **extra}}
        cfg = write_config(base / f"{name}.yaml", base / run, **over)
        proc = run_cli("train", "--config", str(cfg), timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[name] = (base / run, proc.stdout + proc.stderr, json.loads((base / run / "summary.json").read_text()))
    return out


def test_nothing_compiles_after_the_warm_up(runs):
    run_dir, log, summary = runs["first"]
    rows = [r for r in metric_rows(run_dir) if r["step"] <= 12]
    assert [r["step"] for r in rows] == list(range(1, 13))
    means = [r["response_length/mean"] for r in rows]
    assert len(set(means)) > 3 and min(means) < 16  # responses of varying lengths, most before the cap
    assert rows[0]["perf/compiles"] > 0 and rows[0]["time/compile/precompile"] > 0
    assert [r["perf/compiles"] for r in rows[1:]] == [0.0] * 11
    assert [r["perf/compile_s"] for r in rows[1:]] == [0.0] * 11
    assert summary["compile_after_warmup"] == []
    # compile time is reported apart: step 1's time/step is far below its compile seconds
    assert rows[0]["time/step"] < rows[0]["perf/compile_s"]
    shapes = {r["program"]: r["n_shapes"] for r in summary["compile"]}
    # documented bounds (stapo_jax/train/precompile.py): padded update = 1 update + 1 old-log-prob program;
    # rollout: 2 KV-cache lengths (32, 48) x 2 samplings (T = 1, greedy held-out)
    assert shapes["step"] == 1 and shapes["fn"] == 1
    assert shapes["step_jit"] == 4 and shapes["prefill_jit"] == 2
    assert "compiled programs (" in log and "steady state over 11 steps" in log


def test_summary_tables(runs):
    _, _, summary = runs["first"]
    for row in summary["compile"]:
        assert set(row) == {"program", "n_shapes", "n_compiles", "compile_s", "cache_hits"}
        assert row["n_shapes"] == row["n_compiles"] + row["cache_hits"] >= 1
    s = summary["steady_state"]
    assert set(s) >= {"steps", "median_step_s", "rollout_tokens_per_s", "update_tokens_per_s", "mfu", "peak_flops",
                      "chip"}
    assert s["steps"] == 11 and s["chip"].startswith("cpu")
    assert 0 < s["median_step_s"] < 5 and s["rollout_tokens_per_s"] > 0 and s["update_tokens_per_s"] > 0
    assert 0 < s["mfu"] < 1 and s["peak_flops"] > 1e8


@pytest.mark.parametrize("name", ["second", "resumed"])
def test_second_run_and_resume_compile_nothing(runs, name):
    run_dir, log, summary = runs[name]
    rows = metric_rows(run_dir)
    new = [r for r in rows if r["step"] == 13] if name == "resumed" else rows
    assert new and sum(r["perf/compiles"] for r in new) == 0
    assert sum(r["n_compiles"] for r in summary["compile"]) == 0, summary["compile"]
    assert sum(r["cache_hits"] for r in summary["compile"]) > 20
