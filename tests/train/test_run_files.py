"""Run-directory handling (issue 37): an unwritable ``trainer.run_dir`` is one error line naming the path and the
key (exit 2); a resumed run's ``metrics.jsonl`` and TensorBoard events hold each step once; the before-RL
accuracy survives for a resumed run (``summary.json`` is written as soon as it is measured)."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess

import pytest
import yaml
from fixtures_trainer import cli_args, child_env, write_config

from stapo_jax.core.errors import ConfigError
from stapo_jax.train.metrics import MetricsLogger, read_metrics, truncate_rows
from stapo_jax.train.run_files import check_run_dir, earlier_summary, write_summary

PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


def _without_root_file_access():
    """preexec_fn: as root, drop the capabilities that bypass file permissions (the user of a real cluster has
    none), so a read-only folder refuses writes (EACCES) after the exec; a plain user needs nothing."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.parametrize("where", ["missing_below", "existing"])
def test_an_unwritable_run_dir_is_one_line_naming_the_key(tmp_path, where):
    ro = tmp_path / "read_only"
    ro.mkdir()
    run_dir = ro / "run" if where == "missing_below" else ro
    cfg = write_config(tmp_path / "tiny.yaml", run_dir)
    ro.chmod(0o555)
    try:
        out = subprocess.run(cli_args("train", "--config", str(cfg)), env=child_env(1), capture_output=True,
                             text=True, timeout=300, preexec_fn=_without_root_file_access)
    finally:
        ro.chmod(0o755)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert lines == [f"stapo-jax train: error: ConfigError: trainer.run_dir={run_dir}: cannot write there ({ro}: "
                     "permission denied); choose a writable trainer.run_dir"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not (ro / "run").exists()


def test_check_run_dir_names_a_file_in_the_way(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"trainer.run_dir=.*/file/run: cannot write there \(.*/file: not a dir"):
        check_run_dir(str(tmp_path / "file" / "run"))
    check_run_dir(str(tmp_path / "a" / "b"), create=True)
    assert (tmp_path / "a" / "b").is_dir()


def _rows(n0, n1, value):
    return [{"step": s, "loss": value} for s in range(n0, n1 + 1)]


def test_a_resume_truncates_metrics_and_tensorboard_to_the_restored_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsLogger(str(tmp_path), 6, progress=False)
    for row in _rows(1, 5, 1.0):                       # the killed run got to step 5; its checkpoint is step 3
        first.log(row["step"], {"loss": row["loss"]})
    first.close()
    resumed = MetricsLogger(str(tmp_path), 6, progress=False)
    resumed.skip_to(3)
    for row in _rows(4, 6, 2.0):
        resumed.log(row["step"], {"loss": row["loss"]})
    resumed.close()
    raw = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in raw] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]
    assert read_metrics(str(tmp_path)) == raw
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0),
                                                                  (5, 2.0), (6, 2.0)]


def test_truncate_rows_keeps_other_lines_and_counts(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 4}\nnot json\n{"step": 2}\n{"step": 9}\n')
    assert truncate_rows(str(path), 2) == 2
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n'
    assert truncate_rows(str(path), 2) == 0 and truncate_rows(str(tmp_path / "absent.jsonl"), 1) == 0


def test_the_before_rl_accuracy_is_kept_for_a_resumed_run(tmp_path):
    assert earlier_summary(str(tmp_path)) == {}
    write_summary(str(tmp_path), {"heldout_acc_before": 0.25})     # written right after it is measured
    write_summary(str(tmp_path), {"final_step": 3, "preempted": True})
    assert earlier_summary(str(tmp_path)) == {"heldout_acc_before": 0.25, "final_step": 3, "preempted": True}


# --- issue 43: one run per run directory ---------------------------------------------------------------------------

HOLDER = """
import sys, time
from stapo_jax.train.run_dir import RunDirLock
RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_run_on_a_locked_run_dir_stops_at_once_naming_the_holder(tmp_path):
    """Two ``train`` processes on one run_dir used to both run, ``metrics.jsonl`` holding every step twice. Now the
    second exits 2 within 10 s with one line naming the first's pid and host, and writes nothing there."""
    import socket
    import sys
    import time

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], env=child_env(1), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        cfg = write_config(tmp_path / "tiny.yaml", run_dir, trainer={"total_steps": 2})
        t0 = time.monotonic()
        out = subprocess.run(cli_args("train", "--config", str(cfg)), env=child_env(1), capture_output=True,
                             text=True, timeout=120)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait(10)
    print(f"the second train exited {out.returncode} after {took:.1f} s")
    assert out.returncode == 2 and took < 10, (took, out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        f"stapo-jax train: error: ConfigError: trainer.run_dir={run_dir} is in use by another run (pid {holder.pid} "
        f"on {socket.gethostname()}, started "), out.stderr[-3000:]
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no metrics, no config written


def test_the_lock_is_exclusive_and_released(tmp_path):
    from stapo_jax.train.run_dir import RunDirLock

    first = RunDirLock(str(tmp_path)).acquire()
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on "):
        RunDirLock(str(tmp_path)).acquire()
    first.release()
    RunDirLock(str(tmp_path)).acquire().release()


def _tiny(tmp_path, *overrides):
    from stapo_jax.config.schema import load_config

    return load_config(str(write_config(tmp_path / "tiny.yaml", tmp_path / "run")), list(overrides))


def test_a_resume_with_other_settings_lists_them_or_applies_what_may_change(tmp_path):
    """A resume used to overwrite ``config.yaml`` with whatever it was started with. Keys that change what the run
    computes are refused in one line; where and how it runs (steps, logging, kernels, micro-batches) may change."""
    from stapo_jax.train.run_dir import check_resume_settings

    run_dir = str(tmp_path / "run")
    _tiny(tmp_path).save(run_dir)
    assert check_resume_settings(_tiny(tmp_path), run_dir) == []
    ok = _tiny(tmp_path, "trainer.total_steps=80", "trainer.logger=[console]", "model.remat=full",
               "actor.ppo_micro_batch_size=1", f"trainer.run_dir={tmp_path}/elsewhere/../run")
    assert check_resume_settings(ok, run_dir) == ["actor.ppo_micro_batch_size", "model.remat", "trainer.logger",
                                                  "trainer.run_dir", "trainer.total_steps"]
    with pytest.raises(ConfigError) as e:
        check_resume_settings(_tiny(tmp_path, "actor.optim.lr=0.5", "actor.clip_ratio_high=0.3", "model.hidden_size=64",
                                    "trainer.total_steps=80"), run_dir)
    assert str(e.value).startswith(f"trainer.run_dir={run_dir} holds a run with other settings (actor.clip_ratio_high "
                                   "0.28 -> 0.3; actor.optim.lr 0.001 -> 0.5; model.hidden_size 32 -> 64): ")
    assert "trainer.resume=false" in str(e.value) and "\n" not in str(e.value)


def test_a_config_yaml_of_the_older_token_mask_spelling_resumes(tmp_path):
    """A ``config.yaml`` written before ``actor.token_mask`` held the name (``token_mask: null``, the mask chosen by
    ``s2t.enabled``) was refused as ``actor.token_mask None -> 's2t'``; it is now read as the current loader reads
    it, so the same settings resume and a real change is still refused (naming only that key)."""
    import warnings

    from stapo_jax.train.run_dir import check_resume_settings

    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def write_old(*overrides, s2t=True):
        old = _tiny(tmp_path, *overrides).to_dict()
        old["actor"]["token_mask"] = None
        old["s2t"]["enabled"], old["top_entropy"]["enabled"] = s2t, False
        (run_dir / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))

    write_old()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the older spelling's FutureWarning is not shown
        assert check_resume_settings(_tiny(tmp_path), str(run_dir)) == []
        assert check_resume_settings(_tiny(tmp_path, "trainer.total_steps=80"), str(run_dir)) == [
            "trainer.total_steps"]
    write_old("actor.optim.lr=0.5")
    with pytest.raises(ConfigError) as e:
        check_resume_settings(_tiny(tmp_path), str(run_dir))
    assert str(e.value).startswith(f"trainer.run_dir={run_dir} holds a run with other settings (actor.optim.lr "
                                   "0.5 -> 0.001): ")
    write_old("algorithm.recipe=grpo", s2t=False)  # no flag on: no mask
    assert check_resume_settings(_tiny(tmp_path, "algorithm.recipe=grpo"), str(run_dir)) == []
    with pytest.raises(ConfigError) as e:
        check_resume_settings(_tiny(tmp_path, "algorithm.recipe=grpo", "actor.token_mask=clip_cov"), str(run_dir))
    assert "(actor.token_mask 'none' -> 'clip_cov'): " in str(e.value)


def test_config_yaml_describes_the_checkpoints_and_each_start_is_kept(tmp_path):
    """``trainer.total_steps=3`` on a finished 40-step run rewrote ``config.yaml`` (total_steps 3, the new run_dir).
    Now a fresh start writes it, a resume leaves it alone unless it extends the run, and every start's settings
    go to ``config_history/``."""
    import time

    from stapo_jax.train.run_dir import record_start

    run_dir = tmp_path / "run"
    record_start(_tiny(tmp_path, "trainer.total_steps=40"), str(run_dir), resuming=False)
    first = (run_dir / "config.yaml").read_bytes()
    assert yaml.safe_load(first)["trainer"]["total_steps"] == 40
    time.sleep(1.1)  # another second: another history file name
    record_start(_tiny(tmp_path, "trainer.total_steps=3", "trainer.logger=[console]"), str(run_dir), resuming=True)
    assert (run_dir / "config.yaml").read_bytes() == first
    record_start(_tiny(tmp_path, "trainer.total_steps=60"), str(run_dir), resuming=True)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["total_steps"] == 60
    history = sorted(p.name for p in (run_dir / "config_history").iterdir())
    assert [h.split("-")[-1] for h in history] == ["fresh.yaml", "resume.yaml", "resume.yaml"], history
    steps = [yaml.safe_load((run_dir / "config_history" / h).read_text())["trainer"]["total_steps"] for h in history]
    assert sorted(steps) == [3, 40, 60]


def test_a_run_dir_the_system_refuses_is_named_as_the_key():
    """``trainer.run_dir=/proc/x`` ended in a bare FileNotFoundError after the data was loaded; now it is the
    key's one-line error (setup_run makes the folder before loading data or building the model)."""
    with pytest.raises(ConfigError, match=r"^trainer.run_dir=/proc/stapo_jax_x/run: cannot write there \(/proc/"):
        check_run_dir("/proc/stapo_jax_x/run", create=True)
