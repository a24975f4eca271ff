"""Run-directory handling (issue 37): an unwritable ``trainer.run_dir`` is one error line naming the path and the
key (exit 2); a resumed run's ``metrics.jsonl`` and TensorBoard events hold each step once; the before-RL
accuracy survives for a resumed run (``summary.json`` is written as soon as it is measured)."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess

import pytest
from fixtures_trainer import cli_args, child_env, write_config

from stapo_jax.config.schema import ConfigError
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
