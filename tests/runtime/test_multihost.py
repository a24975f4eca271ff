"""Multi-host runs end to end on one machine (issue 10). ``stapo-jax train`` (SFT warm-up, held-out evaluation,
3 RL steps, checkpoints, HF export) runs as 1 process x 4 CPU devices, 2 x 2 and 4 x 1, each layout from its own
SFT warm-up (data-parallel: rows over the 4 devices, gradient all-reduced): the same prompts, sampled tokens and
rewards, parameters and HF exports within 1e-5. Every layout is started by ``stapo-jax launch --local N``, which
starts ``jax.distributed`` also for N = 1, so XLA:CPU runs the all-reduce through gloo in every layout (its
in-process all-reduce sums in another order: bench/sft_grad_layouts.py). kill -9 of both processes after the first
checkpoint, then restarting with the same command, resumes from it; kill -9 of one process makes the other exit
non-zero within the heartbeat bound, naming the dead task; SIGTERM to one process only makes both save the same
step and exit 0; the last restart ends with the uninterrupted run's parameters; ``stapo-jax eval`` in 2 processes
writes the results of 1.

The runs happen once per module (each costs one compile per process on the CI's 2 cores)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import portpicker
import pytest
from safetensors.numpy import load_file

from stapo_jax.runtime import distributed
from stapo_jax.runtime.launch import process_env

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 3
DATA = ["data.gym.size=64", "data.gym.val_size=6", "reward.num_workers=1"]
OVERRIDES = ["sft.steps=40", "sft.lr=1.0e-2", "sft.batch_size=16", f"trainer.total_steps={STEPS}",
             "trainer.train_batch_size=4", "rollout.n=4",
             "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2", "trainer.eval_every=0",
             "trainer.save_every=1", "rollout.max_concurrent_decodes=16", *DATA]
LAYOUTS = ((1, 4), (2, 2), (4, 1))


def _base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAPO_DISTRIBUTED="auto", **extra)
    return env


def _launch(n: int, devices: int, args: list[str], **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "stapo_jax", "launch", "--local", str(n), "--devices-per-process", str(devices),
           "--timeout", "1500", *args]
    return subprocess.run(cmd, cwd=REPO, env=_base_env(**env), capture_output=True, text=True, timeout=1700)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    base = tmp_path_factory.mktemp("layouts")
    out = {}
    for n, d in LAYOUTS:  # every layout runs SFT + held-out evaluation + RL entirely in its own layout
        run_dir = base / f"{n}x{d}"
        t0 = time.perf_counter()
        r = _launch(n, d, ["--config", CONFIG, *OVERRIDES, f"trainer.run_dir={run_dir}"],
                    STAPO_DUMP_EXPERIENCE_DIR=str(run_dir / "dump"))
        assert r.returncode == 0, f"{n}x{d} failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
        out[(n, d)] = {"dir": run_dir, "wall_s": time.perf_counter() - t0, "log": r.stdout}
        print(f"layout {n} process(es) x {d} device(s): {out[(n, d)]['wall_s']:.1f} s wall")
    return out


def test_sft_warmup_equal_across_process_layouts(layouts):
    """The three layouts' own SFT warm-ups end at the same loss (log line, 3 decimals), and their first rollouts
    (sampled from the warm-up's weights) hold the same tokens with sampler log-probs within 1e-5."""
    losses = {}
    for layout, run in layouts.items():
        lines = [x for x in run["log"].splitlines() if x.startswith("[p0] ") and "SFT warm-up: 40 steps" in x]
        assert len(lines) == 1, (layout, run["log"][-3000:])
        losses[layout] = [float(v) for v in lines[0].split("loss ")[1].split(" -> ")]  # printed with 3 decimals
    for layout in ((2, 2), (4, 1)):
        np.testing.assert_allclose(losses[layout], losses[(1, 4)], rtol=0, atol=1.5e-3, err_msg=str(layout))
    assert losses[(1, 4)][1] < 0.5 * losses[(1, 4)][0], losses  # the warm-up learned something
    ref = np.load(layouts[(1, 4)]["dir"] / "dump" / "step_1.npz")
    for layout in ((2, 2), (4, 1)):
        other = np.load(layouts[layout]["dir"] / "dump" / "step_1.npz")
        np.testing.assert_array_equal(other["input_ids"], ref["input_ids"], err_msg=str(layout))
        np.testing.assert_allclose(other["rollout_log_probs"], ref["rollout_log_probs"], rtol=0, atol=1e-5,
                                   err_msg=str(layout))


def test_sft_command_two_processes_equal_one(tmp_path):
    """``stapo-jax sft`` as 2 processes x 2 devices and as 1 x 4: the HF exports (gathered tensor by tensor,
    written by process 0) agree within 1e-5 (bitwise on the 2-core development VM); a batch size that does not
    split over the 4 devices names ``sft.batch_size``."""
    def sft(batch_size: int, run_dir: Path) -> list[str]:
        return ["--command", "sft", "--config", CONFIG, "sft.steps=6", "sft.lr=1.0e-2",
                f"sft.batch_size={batch_size}", *DATA, f"trainer.run_dir={run_dir}"]

    exports = {}
    for n, d in ((2, 2), (1, 4)):
        r = _launch(n, d, sft(8, tmp_path / f"{n}x{d}"))
        assert r.returncode == 0, f"{n}x{d} sft failed:\n{r.stdout[-6000:]}"
        assert sum(x.startswith("[p0] SFT: 6 steps") for x in r.stdout.splitlines()) == 1, r.stdout[-3000:]
        exports[n] = load_file(str(tmp_path / f"{n}x{d}" / "sft_hf" / "model.safetensors"))
        assert not (tmp_path / f"{n}x{d}" / "process_1").exists()
    assert sorted(exports[1]) == sorted(exports[2]) and len(exports[1]) >= 10
    for k in exports[1]:
        np.testing.assert_allclose(exports[2][k], exports[1][k], rtol=0, atol=1e-5, err_msg=k)
    r = _launch(2, 2, sft(6, tmp_path / "bad"))
    assert r.returncode != 0 and "sft.batch_size=6 does not split into 4 data-parallel shards" in r.stdout, \
        r.stdout[-3000:]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_same_prompts_tokens_rewards(layouts):
    ref = layouts[(1, 4)]["dir"] / "dump"
    n_rewarded = 0
    for step in range(1, STEPS + 1):
        one = np.load(ref / f"step_{step}.npz")
        n_rewarded += int((one["rewards"] > 0).sum())
        assert one["response_mask"].sum(-1).std() > 0 or step > 1  # varied responses, not a degenerate batch
        for layout in ((2, 2), (4, 1)):
            other = np.load(layouts[layout]["dir"] / "dump" / f"step_{step}.npz")
            assert sorted(other.files) == sorted(one.files)
            for k in ("input_ids", "attention_mask", "response_mask", "rewards"):
                np.testing.assert_array_equal(other[k], one[k], err_msg=f"{layout} step {step} {k}")
            np.testing.assert_allclose(other["advantages"], one["advantages"], atol=1e-6, err_msg=f"{layout} {step}")
            np.testing.assert_allclose(other["rollout_log_probs"], one["rollout_log_probs"], atol=1e-5,
                                       err_msg=f"{layout} step {step} rollout_log_probs")
    assert n_rewarded > 0  # some sampled answers were correct: advantages and updates are not all zero


def test_parameters_and_hf_exports_equal(layouts):
    ref_dir = layouts[(1, 4)]["dir"] / "hf"
    ref = load_file(str(ref_dir / "model.safetensors"))
    assert len(ref) >= 10
    losses = [row["loss"] for row in _metrics(layouts[(1, 4)]["dir"])]
    assert len(losses) == STEPS and any(abs(x) > 1e-7 for x in losses)  # RL moved the parameters
    for layout in ((2, 2), (4, 1)):
        d = layouts[layout]["dir"] / "hf"
        other = load_file(str(d / "model.safetensors"))
        assert sorted(other) == sorted(ref)
        for k in ref:
            assert other[k].dtype == ref[k].dtype and other[k].shape == ref[k].shape, k
            np.testing.assert_allclose(other[k], ref[k], rtol=0, atol=1e-5, err_msg=f"{layout} {k}")
        assert json.loads((d / "config.json").read_text()) == json.loads((ref_dir / "config.json").read_text())
        s_ref = json.loads((layouts[(1, 4)]["dir"] / "summary.json").read_text())
        s = json.loads((layouts[layout]["dir"] / "summary.json").read_text())
        for key in ("heldout_acc_before", "heldout_acc_after", "final_step", "optimizer_steps"):
            assert s[key] == s_ref[key], (layout, key)
        for row, row_ref in zip(_metrics(layouts[layout]["dir"]), _metrics(layouts[(1, 4)]["dir"])):
            for key in ("reward/mean", "acc/mean", "response_length/mean", "sampling/prompts"):
                assert row[key] == row_ref[key], (layout, key)
            for key in ("loss", "grad_norm", "entropy"):
                np.testing.assert_allclose(row[key], row_ref[key], rtol=1e-4, atol=1e-6, err_msg=f"{layout} {key}")
            assert row["time/coordination"] > 0  # the cross-process gathers are timed


def test_export_loads_in_transformers(layouts):
    import torch
    from transformers import Qwen3ForCausalLM

    d = layouts[(2, 2)]["dir"] / "hf"
    model = Qwen3ForCausalLM.from_pretrained(str(d), torch_dtype=torch.float32)
    ours = load_file(str(d / "model.safetensors"))
    theirs = model.state_dict()
    name = "model.layers.1.mlp.down_proj.weight"
    np.testing.assert_array_equal(theirs[name].numpy(), ours[name])


def test_who_writes_what(layouts):
    run = layouts[(2, 2)]["dir"]
    assert len(_metrics(run)) == STEPS and (run / "tb").is_dir() and (run / "summary.json").is_file()
    assert len(_metrics(run / "process_1")) == STEPS  # process 1 logs into its own file
    assert sorted(p.name for p in (run / "process_1").iterdir()) == ["metrics.jsonl"]  # nothing else
    log = layouts[(2, 2)]["log"]
    lines = [x for x in log.splitlines() if x.strip()]
    assert all(x.startswith(("[p0] ", "[p1] ", "[launch]")) for x in lines), [x for x in lines if x[:2] != "[p"][:3]
    assert any(x.startswith("[p1] ") and "held-out accuracy before RL" in x for x in lines)
    assert sum("train: 100%" in x for x in lines if x.startswith("[p1]")) == 0  # progress bar on process 0 only
    # the end-of-run report (compile table, steady state) on process 0's console only (issue 33)
    assert sum(x.startswith("[p0] ") and ("compiled programs (" in x or "steady state over" in x) for x in lines) == 2
    assert not any(x.startswith("[p1] ") and ("compiled programs (" in x or "steady state over" in x) for x in lines)


def _start_pair(run_dir: Path, port: int, **env) -> list[subprocess.Popen]:
    """``stapo-jax train`` as 2 processes x 2 devices with the layouts' command (SFT warm-up included; a resumed
    run skips it and restores the checkpoint)."""
    args = [sys.executable, "-m", "stapo_jax", "train", "--config", CONFIG, *OVERRIDES, f"trainer.run_dir={run_dir}"]
    return [subprocess.Popen(args, cwd=REPO, env=process_env(i, 2, port, 2, _base_env(**env)),
                             stdout=open(run_dir.parent / f"{run_dir.name}.p{i}.log", "a"), stderr=subprocess.STDOUT)
            for i in range(2)]


def _wait_for(pred, procs, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end or any(p.poll() is not None for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            pytest.fail(f"{what}: not reached (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.02)


def _steps(run_dir: Path) -> list[int]:
    d = run_dir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _tail(path: Path, offset: int) -> str:
    """What ``path`` (a log opened for appending by each run) got after ``offset`` characters."""
    return path.read_text()[offset:] if path.exists() else ""


def test_kill_sigterm_and_resume(layouts, tmp_path):
    """One run dir, four starts of the same 2 x 2 command (the layouts' uninterrupted 2 x 2 run is the reference):
    1. kill -9 of both processes as soon as the first checkpoint is finalized (Orbax renames the step's temporary
       directory into ``checkpoints/<step>`` when it is complete);
    2. restart: it resumes from that step; kill -9 of process 1 there: process 0 exits non-zero within the
       heartbeat bound (``STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S``, read by ``runtime/distributed.initialize``),
       its log naming the dead task and the heartbeat timeout;
    3. restart; SIGTERM to process 1 only: both stop after the same step (the flag is all-gathered,
       ``runtime.collectives.stop_requested``), save it and exit 0;
    4. restart: it resumes from that step and ends with the uninterrupted run's parameters."""
    run = tmp_path / "run"
    run.mkdir()
    logs = [tmp_path / f"run.p{i}.log" for i in range(2)]
    heartbeat = 10
    env = dict(STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S=str(heartbeat))

    def start():
        offsets = [len(x.read_text()) if x.exists() else 0 for x in logs]
        return _start_pair(run, portpicker.pick_unused_port(), **env), offsets

    def both(offsets) -> str:
        return "\n".join(f"--- p{i}\n" + _tail(x, o)[-3000:] for i, (x, o) in enumerate(zip(logs, offsets)))

    # 1. kill -9 of both processes once the first checkpoint is complete
    procs, off = start()
    _wait_for(lambda: 1 in _steps(run), procs, 900, "first checkpoint")
    for p in procs:
        p.kill()
    assert [p.wait(timeout=60) for p in procs] == [-signal.SIGKILL] * 2
    k0 = _steps(run)[-1]
    assert 1 <= k0 < STEPS, _steps(run)
    assert "SFT warm-up: 40 steps" in _tail(logs[0], off[0])  # the first start ran the warm-up
    # 2. restart with the same command: it resumes from k0; kill -9 of process 1 there
    procs, off = start()
    _wait_for(lambda: f"resumed from step {k0}" in _tail(logs[0], off[0]), procs, 600, "resume")
    procs[1].kill()
    t0 = time.monotonic()
    try:
        rc = procs[0].wait(timeout=heartbeat + 60)
    finally:
        procs[0].kill()
    waited = time.monotonic() - t0
    print(f"process 0 exited {rc} {waited:.1f} s after kill -9 of process 1 (heartbeat timeout {heartbeat} s)")
    survivor = _tail(logs[0], off[0])
    assert rc != 0 and waited < heartbeat + 60, (rc, waited)
    assert "Task 1 heartbeat timeout" in survivor and "stopped sending heartbeats" in survivor, survivor[-3000:]
    assert "SFT warm-up" not in survivor  # resumed, not restarted from scratch
    # 3. restart; SIGTERM to process 1 only once it has resumed: both save the same step and exit 0
    procs, off = start()
    _wait_for(lambda: f"resumed from step {k0}" in _tail(logs[1], off[1]), procs, 600, "resume")
    time.sleep(2)  # past the check before the first step (ms after the log line), inside its compiles (> 10 s)
    procs[1].send_signal(signal.SIGTERM)
    assert [p.wait(timeout=300) for p in procs] == [0, 0], both(off)
    stopped = [[x for x in _tail(log, o).splitlines() if x.startswith("final_step:")] for log, o in zip(logs, off)]
    assert stopped[0] == stopped[1] and len(stopped[0]) == 1, stopped
    k = int(stopped[0][0].split(":")[1])
    assert k == k0 + 1 and _steps(run)[-1] == k, (k0, k, _steps(run))  # the step it was in, saved
    for log, o in zip(logs, off):  # process 0 never got the signal: it stopped on the gathered flag
        assert f"SIGTERM: stopping after RL step {k}" in _tail(log, o), both(off)
    # 4. restart with the same command: it resumes from k and ends with the uninterrupted run's parameters
    procs, off = start()
    assert [p.wait(timeout=900) for p in procs] == [0, 0], both(off)
    assert f"resumed from step {k} " in _tail(logs[0], off[0])
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()][-1] == STEPS
    ref = load_file(str(layouts[(2, 2)]["dir"] / "hf" / "model.safetensors"))
    got = load_file(str(run / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    diff = max(float(np.abs(got[n].astype(np.float64) - ref[n]).max()) for n in ref)
    print(f"kill -9 / SIGTERM / resume vs uninterrupted 2 x 2: max |diff| {diff:.3g} (k0={k0}, k={k})")
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=1e-5, err_msg=name)


def test_eval_two_processes_equal_one(layouts, tmp_path):
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"Calculate {a} + {b} - 1.", "answer": str(a + b - 1)}) + "\n"
                             for a, b in ((3, 4), (5, 2), (1, 1))))
    model = layouts[(1, 4)]["dir"] / "hf"
    results = {}
    for n, d in ((1, 4), (2, 2)):
        out = tmp_path / f"eval{n}"
        r = _launch(n, d, ["--command", "eval", "--config", CONFIG, "--model", str(model), "--benchmarks",
                           str(bench), "--limit", "2", "--n-samples", "2", "--max-new-tokens", "6", "--out", str(out)])
        assert r.returncode == 0, r.stdout[-5000:]
        results[n] = json.loads((out / "results.json").read_text())
        assert not (tmp_path / f"eval{n}" / "process_1").exists()
    assert _drop_clock(results[1]) == _drop_clock(results[2])
    assert results[1]["meta"]["limit"] == 2


def _drop_clock(obj):
    """``obj`` without the fields that name the machine or the clock (date, devices, wall seconds)."""
    if isinstance(obj, dict):
        return {k: _drop_clock(v) for k, v in obj.items() if k not in ("date", "devices", "seconds", "time_s")}
    if isinstance(obj, list):
        return [_drop_clock(v) for v in obj]
    return obj


def _run_snippet(code: str, n: int = 2, **env) -> list[subprocess.CompletedProcess]:
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=process_env(i, n, port, 1, _base_env(**env)))
             for i in range(n)]
    return [(p.communicate(timeout=300)[0], p.returncode) for p in procs]


def _check_same_config_errors(setup: str, call_args: str) -> list[str]:
    """Run ``d.check_same_config(<call_args>)`` after ``setup`` (``i`` is the process index) in 2 processes;
    assert both stop with a DistributedError and return each one's message."""
    code = ("import sys; from stapo_jax.runtime import distributed as d; d.initialize(); i = int(sys.argv[1])\n"
            + setup + f"try:\n    d.check_same_config({call_args})\n"
            "except d.DistributedError as e:\n    print('ERR', e); sys.exit(3)\n")
    out = _run_snippet(code)
    assert [rc for _, rc in out] == [3, 3], out
    return [next(x for x in text.splitlines() if x.startswith("ERR")) for text, _ in out]


def test_different_configs_are_named():
    for err in _check_same_config_errors(
            "cfg = {'trainer': {'seed': 1, 'total_steps': 3 + i}, 'actor': {'optim': {'lr': 0.1}},"
            " 'rollout': {'n': 8 if i else 4}}\n", "cfg"):
        assert "'rollout.n'" in err and "'trainer.total_steps'" in err and "actor.optim.lr" not in err, err
        assert "processes [1]" in err


def test_different_training_data_is_named():
    """The trainer's second check (``check_same_config`` over the dataset fingerprints): processes that read
    different data files stop with the training-data message and its remedy, naming the differing split."""
    for err in _check_same_config_errors(
            "from stapo_jax.data.prompts import examples_fingerprint as fp\n"
            "train = [{'index': 0, 'prompt_ids': [1, 2, 3 + i], 'answer': '4'}]\n"
            "val = [{'index': 0, 'prompt_ids': [5], 'answer': '6'}]\n",
            "{'train_prompts_sha256': fp(train), 'val_prompts_sha256': fp(val)}, what='training data', "
            "fix='read the same files'"):
        assert "training data that differs" in err and "'train_prompts_sha256'" in err, err
        assert "val_prompts" not in err and err.endswith("read the same files") and "processes [1]" in err, err


def test_eval_graders_split_rows_over_processes():
    """``stapo-jax eval`` graders (evaluate.make_graders) with 2 processes: each grades its own share of the rows
    (3 + 2 of 5) and both get the one-process scores and counts."""
    code = ("import sys, json; from stapo_jax.runtime import distributed as d; d.initialize(); import jax\n"
            "from stapo_jax.tools.evaluate import make_graders\n"
            "texts = ['\\\\boxed{6}', 'so \\\\boxed{7}', 'no answer', '\\\\boxed{1/2}', '\\\\boxed{0.5}']\n"
            "golds = ['6', '6', '3', '1/2', '1/2']\n"
            "out = {}\n"
            "for name, g in make_graders(['math_verify', 'boxed_exact'], num_workers=1).items():\n"
            "    seen = []; inner = g.scorer.score\n"
            "    g.scorer.score = lambda t, gl, inner=inner, seen=seen: (seen.append(len(t)), inner(t, gl))[1]\n"
            "    scores, stats = g(texts, golds); g.close()\n"
            "    out[name] = [[float(s) for s in scores], stats['n'], stats['n_correct'], sum(seen)]\n"
            "print('OUT', json.dumps(out))\n")
    single, rc1 = _run_snippet(code, n=1)[0]
    assert rc1 == 0, single
    one = json.loads(next(x for x in single.splitlines() if x.startswith("OUT"))[4:])
    assert one["math_verify"][0] == [1.0, 0.0, 0.0, 1.0, 1.0] and one["boxed_exact"][0][0] == 1.0, one
    outs = _run_snippet(code, n=2)
    assert [rc for _, rc in outs] == [0, 0], outs
    two = [json.loads(next(x for x in text.splitlines() if x.startswith("OUT"))[4:]) for text, _ in outs]
    for i, res in enumerate(two):
        for name in ("math_verify", "boxed_exact"):
            assert res[name][:3] == one[name][:3], (name, res, one)
            assert res[name][3] == (3, 2)[i], (name, i, res)  # rows this process graded itself


def test_unreachable_coordinator_fails_clearly():
    port = portpicker.pick_unused_port()
    t0 = time.monotonic()
    with pytest.raises(distributed.DistributedError, match=rf"127\.0\.0\.1:{port}.*after 2s.*INIT_TIMEOUT"):
        distributed.initialize(f"127.0.0.1:{port}", 2, 1, initialization_timeout_s=2)
    assert time.monotonic() - t0 < 15


def test_coordinator_without_peers_says_why_before_jax_aborts():
    """Process 0 alone: JAX aborts it (a C++ check failure, no Python exception) once the other process has not
    registered within the initialization timeout. The stderr must carry our line naming the cause and the
    settings before JAX's DEADLINE_EXCEEDED, and the process must end within the timeout plus start-up."""
    port = portpicker.pick_unused_port()
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from stapo_jax.runtime import distributed\n"
            f"distributed.initialize('127.0.0.1:{port}', 2, 0, initialization_timeout_s=2)\n"
            "print('NOT REACHED')\n")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "STAPO_JAX_ALLOCATOR": "system"})
    assert res.returncode != 0 and "NOT REACHED" not in res.stdout, res
    ours = res.stderr.find(f"process 0 of 2: coordinator at 127.0.0.1:{port}, waiting up to 2 s")
    assert ours >= 0 and "JAX_NUM_PROCESSES=2" in res.stderr and "STAPO_DISTRIBUTED_INIT_TIMEOUT_S" in res.stderr
    assert ours < res.stderr.find("DEADLINE_EXCEEDED"), res.stderr[-2000:]
    assert time.monotonic() - t0 < 100


def test_batch_that_does_not_split_names_the_keys(tmp_path):
    """Issue 43: every batch-shape error at once, each with the nearest values that work (it was one error per
    attempt, none saying what would work), before anything is written; ``ppo_micro_batch_size=auto`` fits."""
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.train.trainer import train

    run_dir = tmp_path / "run"
    cfg = load_config(CONFIG, ["rollout.n=3", "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=1",
                               "trainer.train_batch_size=2", "sft.steps=5", "sft.batch_size=12",
                               f"trainer.run_dir={run_dir}"])
    with pytest.raises(ConfigError) as e:
        train(cfg)  # 8 CPU devices in the test process (conftest)
    assert str(e.value) == (
        "the batch settings do not fit 8 data-parallel shards (1 processes x 8 devices, mesh.data x mesh.fsdp): "
        "actor.ppo_mini_batch_size=1 x rollout.n=3 = 3 sequences do not split into 8 data-parallel shards: nearest "
        "actor.ppo_mini_batch_size that does: 8 (trainer.train_batch_size a multiple of it); sft.batch_size=12 does "
        "not split into 8 data-parallel shards: nearest that does: 8 or 16")
    assert not run_dir.exists()
    cfg = load_config(CONFIG, ["rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=3",
                               "trainer.train_batch_size=8", "trainer.total_steps=1", "sft.steps=0",
                               f"trainer.run_dir={run_dir}"])
    with pytest.raises(ConfigError, match=r"actor.ppo_micro_batch_size=3 does not divide the 4 sequences a shard "
                                          r"gets per mini-batch: nearest that does: 2 or 4 \(or auto\)"):
        train(cfg)
    assert not run_dir.exists()


def test_auto_micro_batches_fit_any_mini_batch_and_device_count():
    """``configs/tiny_cpu.yaml`` had ``ppo_micro_batch_size: 128`` (its 16 x 8 sequences), so changing
    ``rollout.n`` or the mini-batch failed on it; ``auto`` is the mini-batch's share of each device (K = 1)."""
    from stapo_jax.config.schema import load_config
    from stapo_jax.train.batch_shapes import batch_shape_errors

    for n, mini, dp in ((8, 16, 1), (4, 16, 4), (2, 8, 2), (3, 4, 3), (8, 4, 8)):
        cfg = load_config(CONFIG, [f"rollout.n={n}", f"actor.ppo_mini_batch_size={mini}",
                                   f"trainer.train_batch_size={2 * mini}"])
        assert cfg.actor.ppo_micro_batch_size == n * mini and batch_shape_errors(cfg, dp, sft=False) == []


SAMPLER_ALONE = """
import sys, numpy as np
from stapo_jax.runtime import distributed as d
d.initialize()
import jax
from flax import nnx
from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.rollout.driver import RolloutDriver
from stapo_jax.rollout.engine import EngineConfig, Qwen3Engine
from stapo_jax.rollout.multihost import MultiHostRollout, local_mesh
from stapo_jax.runtime.collectives import allgather_max
cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=None,
                  bos_token_id=None, pad_token_id=0, initializer_range=0.5, tie_word_embeddings=False)
mesh = local_mesh()
engine = Qwen3Engine(Qwen3(cfg, rngs=nnx.Rngs(0)), EngineConfig(max_concurrent_decodes=128, max_prefill_length=32,
                     max_decode_length=16, eos_token_ids=(7,)), mesh=mesh)
assert set(engine.mesh.devices.flat) == set(jax.local_devices()), engine.mesh
drv = RolloutDriver(engine, steps_per_sync=4)
prompts = [[1 + i, 2, 3 + i % 5, 9][: 2 + i % 3] for i in range(12)]
kw = dict(num_samples=8, max_new_tokens=6, seed=3)
if jax.process_index() == 0:  # 96 rows, 12 prefills + 96 inserts before the first step, the peer in a gather
    solo = drv.generate(prompts, **kw)
allgather_max(1.0)
both = MultiHostRollout(drv, mesh).generate(prompts, **kw)
if jax.process_index() == 0:
    np.testing.assert_array_equal(both.responses, solo.responses)
    np.testing.assert_allclose(both.rollout_log_probs, solo.rollout_log_probs, rtol=0, atol=1e-5)
    print("ROWS", len(both.responses), "EOS", int((both.responses == 7).any(1).sum()))
"""


def test_sampler_programs_need_no_peer():
    """Every device program of the sampler (prefill, insert, cache resize, decode step) runs on this process's
    devices and needs no peer: 2 processes x 2 devices, process 0 samples 96 rows at 128 slots (the tiny
    config's ``rollout.max_concurrent_decodes``, which deadlocked before issue 34: 108 programs dispatched
    before the first step, XLA:CPU admits 32 per device) while process 1 waits in a cross-process all-gather;
    then both sample the batch together (``MultiHostRollout``) and process 0 gets its solo tokens. Each process
    is killed (SIGKILL, as a deadlocked ``jax.distributed`` process ignores SIGTERM) after 240 s."""
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen([sys.executable, "-c", SAMPLER_ALONE], cwd=REPO, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True,
                              env=process_env(i, 2, port, 2, _base_env())) for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append((p.communicate(timeout=240)[0], p.returncode))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail("the sampler deadlocked (killed after 240 s)")
    assert [rc for _, rc in outs] == [0, 0], outs
    assert "ROWS 96 EOS" in outs[0][0], outs[0][0][-2000:]
