"""``bench/gpu_check.sh --cpu-smoke`` (issue 33, item 6): the accelerator check's four stages (train, update vs
PyTorch, decode vs HF generate, attention implementations) plus the decode-step HLO, at tiny shapes on CPU; every
stage prints its figures, and the figures of the training stage come from metrics.jsonl / summary.json
(bench/gpu_check_report.py)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import gpu_check_report  # noqa: E402
from xla_env import xla_flags

REPO = Path(__file__).resolve().parents[2]


def test_cpu_smoke_runs_every_stage_and_prints_its_figures(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    env["XLA_FLAGS"] = xla_flags()  # not the suite's 8 simulated CPU devices: the check runs on one device
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu-smoke"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=2400)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    stages = re.findall(r"^=== (\w)\. ", out, re.M)
    assert stages == ["a", "b", "c", "d", "e"], out
    # a: one line per RL step as it lands, then the summary's lines (figures, or why the build has none)
    steps = [int(s) for s in re.findall(r"^train step (\d+): step [\d.]+ s, rollout [\d.]+ s", out, re.M)]
    assert steps == [1, 2], out
    assert re.search(r"^train steady state: ", out, re.M) and re.search(r"^train compile: ", out, re.M), out
    # b: our update and torch's, tokens/s each, and the step-0 losses side by side
    assert re.search(r"step-0 loss ours [-\d.]+ vs torch [-\d.]+", out), out
    assert len(re.findall(r"update .*: +[\d.]+ tok/s", out)) >= 2, out
    # c: HF generate and ours, tokens/s
    assert re.search(r"HF generate [\d.]+ tok/s", out) and re.search(r"ours steps_per_sync=1.*: [\d.]+ tok/s", out), out
    # d: parity of blockwise against xla, then tokens/s of each implementation
    assert re.search(r"blockwise vs xla \(float32, T=128\): loss rel [\d.e+-]+", out), out
    assert re.search(r"xla: +\d+ tokens/s", out) and re.search(r"blockwise: +\d+ tokens/s", out), out
    # e: the decode-step HLO bytes
    assert re.search(r"HLO bytes ratio [\d.]+", out), out
    assert re.search(r"^total \d+ s$", out, re.M), out
    for name in ("machine", "train", "update", "rollout", "attention", "decode_step", "summary"):
        assert (tmp_path / "out" / f"{name}.log").stat().st_size > 0, name


def test_report_prints_steady_state_and_compile_table_or_their_absence(tmp_path, capsys):
    gpu_check_report.summary(tmp_path)
    assert "no " in capsys.readouterr().out  # no summary.json yet: the run was cut short
    (tmp_path / "summary.json").write_text(json.dumps({"final_step": 6}))
    gpu_check_report.summary(tmp_path)
    out = capsys.readouterr().out
    assert "has no 'steady_state' entry" in out and "has no 'compile' entry" in out
    (tmp_path / "summary.json").write_text(json.dumps({
        "steady_state": {"steps": 5, "median_step_s": 2.5, "rollout_tokens_per_s": 31000.0, "mfu": 0.37,
                         "chip": "H200"},
        "compile": [{"program": "step", "n_shapes": 2, "n_compiles": 2, "compile_s": 12.5, "cache_hits": 0},
                    {"program": "step_jit", "n_shapes": 4, "n_compiles": 4, "compile_s": 7.5, "cache_hits": 1}]}))
    gpu_check_report.summary(tmp_path)
    out = capsys.readouterr().out
    assert "train steady state: steps 5, median_step_s 2.5, rollout_tokens_per_s 31000.0, mfu 0.37, chip H200" in out
    assert "train compile: 2 programs, 20.0 s in all" in out
    assert "compile program step_jit, n_shapes 4, n_compiles 4, compile_s 7.5, cache_hits 1" in out


def test_step_line_keeps_the_fields_a_row_has():
    row = {"step": 4, "time/step": 2.5, "time/rollout": 1.25, "rollout/tokens_per_s": 30000.4, "time/update": 1.0}
    assert gpu_check_report.step_line(row) == "train step 4: step 2.50 s, rollout 1.25 s, 30000 tok/s, update 1.00 s"
