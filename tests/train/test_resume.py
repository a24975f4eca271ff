"""Kill-and-resume equality of ``stapo-jax train`` (issue 5, checkpoints): a run killed with SIGKILL and resumed,
and a run stopped by SIGTERM (preemption) and resumed, end with the same parameters and optimizer state as an
uninterrupted run (tiny fp32 model, max abs diff <= 1e-6) and see the same samples (per-step rewards, lengths,
entropies and losses; the data iterator position).

Three runs of the same config start together in child processes: U runs to the end; K is SIGKILLed as soon as
its checkpoint 2 is committed; T gets SIGTERM once its checkpoint 1 is committed. Then K and T are resumed
with the same command line (``trainer.resume`` defaults to true).
"""
from __future__ import annotations

import json
import re
import signal

import numpy as np
import pytest

from fixtures_trainer import (TINY_CONFIG, committed_steps, deterministic_part, flat_arrays, load_safetensors_dir, max_abs_diff,
                              metric_rows, metrics_by_step, restore_raw, start_cli, wait_for_checkpoint, write_config)

TOTAL = 12          # steps after compilation take ~0.1 s: enough of them that the kill lands mid-run
TOL = 1e-6
COMPARED = ("reward/mean", "acc/mean", "response_length/mean", "entropy", "loss", "pg_loss", "grad_norm",
            "s2t/masked_frac", "advantages/abs_mean", "sampler_trainer/logp_diff_mean")


def _run(tmp, name):
    run_dir = tmp / name
    # no held-out evaluation (faster), except in T: its resumed run prints the accuracy before and after RL
    gym = dict(TINY_CONFIG["data"]["gym"], val_size=4 if name == "T" else 0)
    cfg = write_config(tmp / f"{name}.yaml", run_dir, trainer={"total_steps": TOTAL, "save_every": 1,
                                                                "keep_checkpoints": TOTAL + 1},
                       data=dict(TINY_CONFIG["data"], gym=gym))
    return run_dir, cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    out = {}
    procs = {}
    for name in ("U", "K", "T"):
        run_dir, cfg = _run(tmp, name)
        log = tmp / f"{name}.log"
        procs[name] = start_cli("train", "--config", str(cfg), log_path=log)
        out[name] = {"run_dir": run_dir, "cfg": cfg, "log": log}
    try:
        # T: SIGTERM once its first checkpoint is committed (the loop is running and has installed its handler)
        wait_for_checkpoint(procs["T"], out["T"]["run_dir"] / "checkpoints", 1, 900, out["T"]["log"])
        procs["T"].send_signal(signal.SIGTERM)
        # K: SIGKILL right after checkpoint 2 is committed; a later step's save may be half-written
        wait_for_checkpoint(procs["K"], out["K"]["run_dir"] / "checkpoints", 2, 900, out["K"]["log"])
        procs["K"].send_signal(signal.SIGKILL)
        out["K"]["rc"] = procs["K"].wait(60)
        out["K"]["dir_at_kill"] = sorted(p.name for p in (out["K"]["run_dir"] / "checkpoints").iterdir())
        out["K"]["committed_at_kill"] = committed_steps(out["K"]["run_dir"] / "checkpoints")
        out["K"]["rows_at_kill"] = metric_rows(out["K"]["run_dir"])
        out["T"]["rc"] = procs["T"].wait(300)
        out["T"]["log_first"] = out["T"]["log"].read_text()
        out["T"]["committed_at_stop"] = committed_steps(out["T"]["run_dir"] / "checkpoints")
        out["T"]["summary_first"] = json.loads((out["T"]["run_dir"] / "summary.json").read_text())
        out["U"]["rc"] = procs["U"].wait(900)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for name in ("K", "T"):   # resume both with the unchanged command line
        log = tmp / f"{name}_resumed.log"
        procs[name] = start_cli("train", "--config", str(out[name]["cfg"]), log_path=log)
        out[name]["log_resumed"] = log
    try:
        for name in ("K", "T"):
            out[name]["rc_resumed"] = procs[name].wait(900)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for name in ("U", "K", "T"):
        for key in ("log", "log_resumed"):
            if key in out[name]:
                out[name][key + "_text"] = out[name][key].read_text()
    return out


def _resumed_from(text: str) -> int:
    m = re.search(r"resumed from step (\d+)", text)
    assert m, text[-3000:]
    return int(m.group(1))


def _final(run_dir):
    state, data, meta = restore_raw(run_dir / "checkpoints", TOTAL)
    return state, data, meta


def test_uninterrupted_run_learns_something(runs):
    u = runs["U"]
    assert u["rc"] == 0, u["log_text"][-3000:]
    rows = metrics_by_step(u["run_dir"])
    assert sorted(rows) == list(range(1, TOTAL + 1))
    # non-trivial updates: otherwise "same parameters" would hold for a run that never changes them
    assert sum(rows[s]["grad_norm"] > 0 for s in rows) >= TOTAL // 2
    assert any(rows[s]["reward/mean"] > 0 for s in rows if s > 6)
    assert committed_steps(u["run_dir"] / "checkpoints") == list(range(1, TOTAL + 1))


def test_sigkill_then_resume_equals_uninterrupted(runs):
    k, u = runs["K"], runs["U"]
    assert k["rc"] == -signal.SIGKILL
    at_kill = k["committed_at_kill"]
    assert 2 in at_kill and max(at_kill) < TOTAL, (at_kill, "the kill must land before the run ends")
    assert k["rc_resumed"] == 0, k["log_resumed_text"][-3000:]
    start = _resumed_from(k["log_resumed_text"])
    # the resume point is the newest *committed* checkpoint at kill time, never a half-written one
    assert start == max(at_kill), (start, k["dir_at_kill"])
    assert "SFT warm-up" not in k["log_resumed_text"]          # the restored state already has it

    su, du, mu = _final(u["run_dir"])
    sk, dk, mk = _final(k["run_dir"])
    fu, fk = flat_arrays(su), flat_arrays(sk)
    assert any("params" in n for n in fu) and any("opt_state" in n for n in fu)
    params = {n: a for n, a in fu.items() if "['params']" in n}
    moved = max_abs_diff(params, {n: a for n, a in flat_arrays(restore_raw(u["run_dir"] / "checkpoints", 1)[0])
                                  .items() if "['params']" in n})
    assert moved > 1e-4                                            # training changed the parameters
    assert max_abs_diff(fu, fk) <= TOL                             # params, Adam moments, counts, step, RNG
    assert du == dk and mu == mk                                   # iterator position, dataset fingerprint
    assert max_abs_diff(load_safetensors_dir(u["run_dir"] / "hf"), load_safetensors_dir(k["run_dir"] / "hf")) <= TOL

    # metrics.jsonl and TensorBoard hold each step once: the resume dropped the killed run's rows after the
    # restored step (it wrote them again)
    assert [r["step"] for r in metric_rows(k["run_dir"])] == list(range(1, TOTAL + 1))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(k["run_dir"] / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(1, TOTAL + 1))

    # the same samples: every step's rollout statistics and losses equal the uninterrupted run's
    ru, rk = metrics_by_step(u["run_dir"]), metrics_by_step(k["run_dir"])
    assert sorted(rk) == sorted(ru) == list(range(1, TOTAL + 1))
    for s in range(1, TOTAL + 1):
        for key in COMPARED:
            assert np.isclose(rk[s][key], ru[s][key], rtol=1e-5, atol=1e-6), (s, key, rk[s][key], ru[s][key])
    # rows the killed process wrote before dying agree too (they were re-done from the checkpoint)
    for row in k["rows_at_kill"]:
        for key in COMPARED:
            assert np.isclose(row[key], ru[row["step"]][key], rtol=1e-5, atol=1e-6), (row["step"], key)


def test_sigterm_saves_exits_zero_and_resumes(runs):
    t, u = runs["T"], runs["U"]
    assert t["rc"] == 0, t["log_first"][-3000:]
    m = re.search(r"SIGTERM: stopping after RL step (\d+)", t["log_first"])
    assert m, t["log_first"][-3000:]
    stopped = int(m.group(1))
    assert 1 < stopped < TOTAL
    assert max(t["committed_at_stop"]) == stopped                  # the stop step itself was saved
    assert t["summary_first"].get("preempted") is True
    assert "hf_export" not in t["summary_first"]                   # exported only at the real end

    assert t["rc_resumed"] == 0, t["log_resumed_text"][-3000:]
    assert _resumed_from(t["log_resumed_text"]) == stopped
    su, du, _ = _final(u["run_dir"])
    st, dt, _ = _final(t["run_dir"])
    assert max_abs_diff(flat_arrays(su), flat_arrays(st)) <= TOL
    assert du == dt
    ru, rt = metrics_by_step(u["run_dir"]), metrics_by_step(t["run_dir"])
    assert sorted(rt) == list(range(1, TOTAL + 1))
    for s in range(1, TOTAL + 1):
        assert deterministic_part(rt[s]).keys() == deterministic_part(ru[s]).keys()
        for key in COMPARED:
            assert np.isclose(rt[s][key], ru[s][key], rtol=1e-5, atol=1e-6), (s, key, rt[s][key], ru[s][key])


def test_a_resumed_run_prints_the_accuracy_before_and_after_rl(runs):
    """The accuracy before RL is measured once, by the run's first start (before its SIGTERM), and printed again
    by the resumed run, which measures the accuracy after RL."""
    t = runs["T"]
    first = re.search(r"held-out accuracy before RL: ([\d.]+) \((\d+) problems", t["log_first"])
    assert first, t["log_first"][-3000:]
    assert t["summary_first"]["heldout_acc_before"] == pytest.approx(float(first.group(1)), abs=5e-5)
    resumed = t["log_resumed_text"]
    assert f"held-out accuracy before RL: {first.group(1)} (measured by the run's first start)" in resumed
    assert re.search(rf"held-out accuracy after RL:\s+[\d.]+ \({first.group(2)} problems, greedy\)", resumed)
    summary = json.loads((t["run_dir"] / "summary.json").read_text())
    assert f"heldout_acc_before: {summary['heldout_acc_before']}\n" in resumed
    assert f"heldout_acc_after: {summary['heldout_acc_after']}\n" in resumed


def test_resume_false_starts_fresh_beside_the_earlier_run(runs, tmp_path):
    """``trainer.resume=false`` in the finished run's directory (a copy of U's): the earlier run's checkpoints,
    metrics and summary move into ``replaced-<time>/`` intact, and the fresh 2-step run's ``metrics.jsonl`` and
    checkpoints hold only its own steps (before, the earlier run's 12 rows stayed in the file, and its
    checkpoints were resumed from by the next plain run)."""
    import shutil

    from fixtures_trainer import run_cli

    u = runs["U"]
    assert u["rc"] == 0, u["log_text"][-3000:]
    run_dir = tmp_path / "R"
    shutil.copytree(u["run_dir"], run_dir)
    gym = dict(TINY_CONFIG["data"]["gym"], val_size=0)
    cfg = write_config(tmp_path / "R.yaml", run_dir, trainer={"total_steps": 2, "save_every": 1, "resume": False},
                       data=dict(TINY_CONFIG["data"], gym=gym))
    res = run_cli("train", "--config", str(cfg))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "trainer.resume=false: moved the earlier run's" in res.stderr + res.stdout
    replaced = [p for p in run_dir.iterdir() if p.name.startswith("replaced-")]
    assert len(replaced) == 1
    old = replaced[0]
    assert committed_steps(old / "checkpoints")[-1] == TOTAL
    assert sorted(metrics_by_step(old)) == list(range(1, TOTAL + 1))
    assert json.loads((old / "summary.json").read_text())["final_step"] == TOTAL
    assert committed_steps(run_dir / "checkpoints") == [1, 2]
    assert [r["step"] for r in metric_rows(run_dir)] == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 2


def test_a_smaller_total_steps_ends_at_once_and_keeps_config_yaml(runs, tmp_path):
    """Issue 43: ``trainer.total_steps=3`` on the finished 12-step run U (a copy): it used to rewrite ``config.yaml``
    with total_steps 3 and the new run_dir. Now it ends at once with a note, ``config.yaml``, the metrics and the
    summary unchanged; the start's settings go to ``config_history/``."""
    import shutil

    from fixtures_trainer import run_cli

    u = runs["U"]
    run_dir = tmp_path / "U"
    shutil.copytree(u["run_dir"], run_dir)
    before = {name: (run_dir / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json")}
    cfg = write_config(tmp_path / "U.yaml", run_dir, trainer={"total_steps": 3, "save_every": 1,
                                                               "keep_checkpoints": TOTAL + 1},
                       data=dict(TINY_CONFIG["data"], gym=dict(TINY_CONFIG["data"]["gym"], val_size=0)))
    res = run_cli("train", "--config", str(cfg))
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    assert f"trainer.total_steps=3: the run in {run_dir} already reached step {TOTAL}; nothing to do" in text
    assert f"final_step: {TOTAL}" in res.stdout
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    history = list((run_dir / "config_history").iterdir())
    assert len(history) == 2 and sorted(h.name.split("-")[-1] for h in history) == ["fresh.yaml", "resume.yaml"]
