"""A run survives a broken reward pool and never outlives a failure (issue 34 items 3-5).

* In a real in-process ``train`` run (tiny_cpu shape, gym rewards in a 2-worker pool), the forkserver, a worker
  and the pool's manager thread are killed in the middle of ``score`` (between two ``schedule`` calls of one
  batch) in RL steps 2, 3 and 4: the run finishes with the rewards of an undisturbed run, no verifier error, and
  ``reward/n_pool_restarts`` >= 1 in exactly those steps. A pool that breaks on every attempt stops the call with
  one line naming the cause after ``max_restarts`` rebuilds.
* ``stapo-jax train`` whose step 1 raises (non-finite parameters) exits non-zero within a bound, pool and logger
  threads notwithstanding.
* Stall watchdog: process 1 of a 2-process run sleeps forever in its setup (test hook ``STAPO_TEST_HANG``): both
  processes exit non-zero (75) within the bound, each log holding the stall line and the Python thread stacks;
  a restart resumes from the step-1 checkpoint and finishes. SIGTERM to the run's process group stops it after
  the step, the reward pool intact (no rebuild).
* Pool process lifetime: a group SIGTERM leaves a ``VerifierPool``'s forkserver and workers alive and usable (no
  rebuild); a SIGKILLed owner leaves no pool process behind.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import portpicker
import psutil
import pytest

from stapo_jax.rewards.pool import PoolFailure, VerifierPool
from stapo_jax.runtime.launch import process_env
from stapo_jax.runtime.watchdog import EXIT_STALL, HANG_ENV
from xla_env import xla_flags

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")
STEPS = 4
OVERRIDES = ["sft.steps=0", f"trainer.total_steps={STEPS}", "trainer.train_batch_size=8", "rollout.n=4",
             "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=2", "trainer.eval_every=0",
             "trainer.save_every=0", "trainer.export_hf=false", "data.gym.size=64", "data.gym.val_size=0",
             "reward.num_workers=2", "rollout.max_concurrent_decodes=16", "model.num_hidden_layers=1",
             "trainer.logger=[console]"]


def _forkservers() -> list[psutil.Process]:
    return [c for c in psutil.Process().children() if "forkserver" in " ".join(c.cmdline())]


def _kill(target: str, threads_before: set[int]) -> None:
    """SIGKILL the forkserver or one pool worker, or end the pool's pebble manager thread (an exception raised in
    it: the thread dies as from a bug)."""
    if target == "forkserver":
        for p in _forkservers():
            os.kill(p.pid, signal.SIGKILL)
    elif target == "worker":
        workers = [w for f in _forkservers() for w in f.children()]
        os.kill(workers[0].pid, signal.SIGKILL)
    else:
        managers = [t for t in threading.enumerate() if t.name.endswith("(pool_manager_loop)")
                    and t.ident not in threads_before]
        assert managers, [t.name for t in threading.enumerate()]
        for t in managers:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(t.ident), ctypes.py_object(SystemExit))


def _install_killer(monkeypatch, plan: dict[int, str]) -> list[str]:
    """Kill ``plan[r]`` during the r-th ``VerifierPool.run`` (1-based) once half of its items are scheduled and
    scored, then wait 0.5 s (pebble's status loop runs every 0.1 s) before the other half is scheduled: the pool
    is idle at the kill, as in the original failure, so the kill always breaks it."""
    import concurrent.futures

    import pebble

    before = {t.ident for t in threading.enumerate()}
    state = {"run": 0, "futures": [], "n": 0}
    done: list[str] = []
    run, schedule = VerifierPool.run, pebble.ProcessPool.schedule

    def counting_run(self, fn, arg_tuples, timeout_s):
        state.update(run=state["run"] + 1, futures=[], n=len(arg_tuples))
        return run(self, fn, arg_tuples, timeout_s)

    def killing_schedule(self, *a, **k):
        fut = schedule(self, *a, **k)
        state["futures"].append(fut)
        target = plan.get(state["run"])
        if target and len(state["futures"]) == state["n"] // 2 and len(done) < state["run"] - 1:
            concurrent.futures.wait(state["futures"], timeout=120)
            done.append(target)
            _kill(target, before)
            time.sleep(0.5)
        return fut

    monkeypatch.setattr(VerifierPool, "run", counting_run)
    monkeypatch.setattr(pebble.ProcessPool, "schedule", killing_schedule)
    return done


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_train_survives_killed_forkserver_worker_and_manager(tmp_path, monkeypatch):
    from stapo_jax.config.schema import load_config
    from stapo_jax.train.trainer import train

    out = {}
    for name in ("reference", "killed"):
        if name == "killed":
            done = _install_killer(monkeypatch, {2: "forkserver", 3: "worker", 4: "manager"})
        cfg = load_config(CONFIG, [*OVERRIDES, f"trainer.run_dir={tmp_path / name}"])
        t0 = time.perf_counter()
        summary = train(cfg)
        print(f"{name}: {time.perf_counter() - t0:.1f} s")
        assert summary["final_step"] == STEPS
        out[name] = _metrics(tmp_path / name)
    assert done == ["forkserver", "worker", "manager"]
    ref, got = out["reference"], out["killed"]
    restarts = [got[s]["reward/n_pool_restarts"] for s in range(1, STEPS + 1)]
    print("restarts per step:", restarts, "score_mean:", [got[s]["reward/score_mean"] for s in got])
    assert restarts == [0, 1, 1, 1], restarts
    assert all(ref[s]["reward/n_pool_restarts"] == 0 for s in ref)
    assert any(ref[s]["reward/score_mean"] > 0 for s in ref)  # rewards that a lost item would change
    for s in range(1, STEPS + 1):
        assert got[s]["reward/n_error"] == 0 == got[s]["reward/n_timeout"], got[s]
        for key in ("reward/score_mean", "reward/mean", "acc/mean"):
            assert got[s][key] == ref[s][key], (s, key, got[s][key], ref[s][key])


def test_pool_that_keeps_breaking_stops_with_one_line(monkeypatch):
    import pebble

    schedule = pebble.ProcessPool.schedule
    calls = []

    def killing_schedule(self, *a, **k):
        fut = schedule(self, *a, **k)
        if not calls or calls[-1] is not self:  # the first item of every (re)built pool: kill its workers
            calls.append(self)
            end = time.monotonic() + 60
            while len(workers := [w for f in _forkservers() for w in f.children()]) < 2 and time.monotonic() < end:
                time.sleep(0.05)  # both workers started (slow on a loaded machine)
            for w in workers:
                os.kill(w.pid, signal.SIGKILL)
        return fut

    monkeypatch.setattr(pebble.ProcessPool, "schedule", killing_schedule)
    with VerifierPool(2, max_restarts=2) as pool:
        t0 = time.monotonic()
        with pytest.raises(PoolFailure) as e:
            pool.run(time.sleep, [(0.5,)] * 4, timeout_s=5.0)
        assert time.monotonic() - t0 < 120
    msg = str(e.value)
    assert "\n" not in msg and "reward pool failed 3 times" in msg and "max_pool_restarts=2" in msg, msg
    assert any(c in msg for c in ("(last: a worker died", "(last: pebble reports the pool broken",
                                  "All workers expired")), msg
    assert pool.n_restarts == 2 and len(calls) == 3


def test_run_that_raises_in_step_one_exits(tmp_path):
    """actor.optim.lr=1e39 overflows float32: the parameters are non-finite after RL step 1's update and the
    trainer raises FloatingPointError with a reward pool, TensorBoard and Orbax running. The process ends within
    60 s of printing the traceback, with exit code 1."""
    args = [sys.executable, "-m", "stapo_jax", "train", "--config", CONFIG,
            *[o for o in OVERRIDES if not o.startswith("trainer.logger")], "actor.optim.lr=1.0e39",
            "trainer.save_every=1", "trainer.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            f"trainer.run_dir={tmp_path / 'run'}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(1))
    log = tmp_path / "log"
    p = subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 1500
        while "FloatingPointError" not in log.read_text():
            assert p.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.1)
        t0 = time.monotonic()
        rc = p.wait(timeout=300)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    print(f"exited {rc} {took:.1f} s after the traceback")
    assert rc == 1 and "FloatingPointError: parameters became non-finite in RL step 1" in text, text[-3000:]
    assert took < 60, took


STALL_S = 30  # the hanging start's bound: above its (cached) model build before the first setup mark


def _start_pair(run_dir: Path, port: int, log_paths, steps: int, stall_s: float | None = None,
                **env) -> list[subprocess.Popen]:
    """The pair's command; ``stall_s`` sets ``trainer.stall_timeout_s`` (None: the backend's default, 600 s on
    CPU, for the starts that must finish whatever the machine's load)."""
    stall = [] if stall_s is None else [f"trainer.stall_timeout_s={stall_s}"]
    args = [sys.executable, "-m", "stapo_jax", "train", "--config", CONFIG, *OVERRIDES,
            f"trainer.total_steps={steps}", "trainer.save_every=1", "trainer.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", *stall, f"trainer.run_dir={run_dir}"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", HANG_ENV))}
    base.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S="300", **env)
    return [subprocess.Popen(args, cwd=REPO, env=process_env(i, 2, port, 1, base),
                             stdout=open(log_paths[i], "a"), stderr=subprocess.STDOUT) for i in range(2)]


def _run_pair(run_dir: Path, log_paths, steps: int, stall_s: float | None = None,
              **env) -> tuple[list[int], list[str]]:
    """Start the pair, wait for both; returns the exit codes and what each log got from this start."""
    offsets = [len(x.read_text()) if x.exists() else 0 for x in log_paths]
    procs = _start_pair(run_dir, portpicker.pick_unused_port(), log_paths, steps, stall_s, **env)
    codes = [p.wait(timeout=1500) for p in procs]
    return codes, [x.read_text()[o:] for x, o in zip(log_paths, offsets)]


def test_stall_watchdog_ends_both_processes_and_restart_resumes(tmp_path):
    """2 processes x 1 device. 1: one RL step, checkpointed. 2: the same run for 3 steps; process 1 sleeps forever
    at its first setup mark (after the model is built; the test hook ``STAPO_TEST_HANG``), process 0 then waits
    in the next all-gather (the training prompts' fingerprints): no compile sits between the two processes' last
    marks, so the bound holds on a slow machine. Both watchdogs fire (the stall line, every thread's stack), both
    processes exit non-zero (75 from the watchdog; one whose peer exited during its 5 s grace period may instead
    fail in the collective). 3: the same command without the hook resumes from step 1 and finishes."""
    run = tmp_path / "run"
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    codes, texts = _run_pair(run, logs, 1)
    assert codes == [0, 0], [t[-2000:] for t in texts]
    codes, texts = _run_pair(run, logs, 3, STALL_S, **{HANG_ENV: "1:setup"})
    assert all(c != 0 for c in codes) and EXIT_STALL in codes, (codes, [t[-2000:] for t in texts])
    assert "sleeps forever in phase 'setup'" in texts[1] and "sleeps forever" not in texts[0]
    for i, t in enumerate(texts):
        line = next((x for x in t.splitlines() if x.startswith("stall watchdog: no progress for")), t[-3000:])
        assert f"in phase 'setup' on process {i}" in line, line
        idle = int(line.split("no progress for ")[1].split(" s")[0])
        assert STALL_S <= idle <= STALL_S + 10, line  # within the bound (the thread checks every second)
        assert "(most recent call first)" in t and "in setup_run" in t  # the main thread's stack, in the trainer's setup
    assert 'watchdog.py", line' in texts[1] and " in mark" in texts[1]  # process 1: asleep in the test hook
    assert "distributed.py" in texts[0]  # process 0: waiting in check_same_config's all-gather
    codes, texts = _run_pair(run, logs, 3)
    assert codes == [0, 0], [t[-2000:] for t in texts]
    assert "resumed from step 1" in texts[0] and "final_step: 3" in texts[0], texts[0][-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and np.isfinite(rows[-1]["loss"])


def test_sigterm_to_the_process_group_stops_after_the_step(tmp_path):
    """The root cause of the reported failure: SIGTERM to the run's whole process group (what ``timeout``, a
    scheduler's time limit or ``kill -- -PGID`` send) reached the reward pool too. The trainer takes SIGTERM as
    "checkpoint after this step and exit 0", but pebble's workers exited with code 15 and the forkserver died,
    so the next scoring raised ``RuntimeError: Unexpected error within the Pool``. Now the pool's processes never
    take a group SIGTERM (rewards/pool.py): the run stops cleanly after the step, without a pool rebuild."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "stapo_jax", "train", "--config", CONFIG, *OVERRIDES, "trainer.total_steps=50",
            "trainer.save_every=0", "trainer.train_batch_size=4", "actor.ppo_mini_batch_size=2",
            f"trainer.run_dir={run}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(1))
    log = tmp_path / "log"
    p = subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        end = time.monotonic() + 600
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert p.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGTERM)  # after RL step 1: the pool is idle or scoring step 2
        rc = p.wait(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "Unexpected error within the Pool" not in text and "SIGTERM: stopping after RL step" in text
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    k = len(rows)
    assert 2 <= k < 50 and (run / "checkpoints" / str(k)).is_dir(), (k, text[-2000:])
    assert [r["reward/n_pool_restarts"] for r in rows] == [0] * k and all(r["reward/n_error"] == 0 for r in rows)
    assert "rebuilding it" not in text, text[-3000:]


def test_ctrl_c_to_a_2x2_launch_checkpoints_the_last_step(tmp_path):
    """Issue 43: Ctrl-C (SIGINT) to ``stapo-jax launch --local 2 --devices-per-process 2`` printed a
    KeyboardInterrupt traceback per process and exited 130 with the running step lost. Now the launcher forwards it
    as SIGTERM: both processes checkpoint the step they finish and exit 0, and so does the launcher."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "stapo_jax", "launch", "--local", "2", "--devices-per-process", "2", "--config",
            CONFIG, *OVERRIDES, "trainer.total_steps=50", "trainer.train_batch_size=4",
            "actor.ppo_mini_batch_size=2", f"trainer.run_dir={run}"]
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    log = tmp_path / "log"
    p = subprocess.Popen(args, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        end = time.monotonic() + 600
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert p.poll() is None and time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.1)
        os.kill(p.pid, signal.SIGINT)  # after RL step 1, to the launcher only (as a terminal's Ctrl-C would)
        rc = p.wait(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    k = len(rows)
    assert 1 <= k < 50 and [r["step"] for r in rows] == list(range(1, k + 1)), text[-3000:]
    assert sorted(os.listdir(run / "checkpoints")) == [str(k)], text[-3000:]  # the last finished step
    for i in range(2):
        assert f"[p{i}] final_step: {k}" in text and f"[p{i}] preempted: True" in text, text[-3000:]


POOL_OWNER = """
import json, os, signal, sys, time
import psutil
from stapo_jax.rewards.pool import VerifierPool

term = []
signal.signal(signal.SIGTERM, lambda *_: term.append(1))
pool = VerifierPool(2)
first = pool.run(os.getpid, [()] * 8, 60.0)
pids = [c.pid for c in psutil.Process().children(recursive=True)]
print(json.dumps({"pids": pids,
                  "ok": all(s == "ok" for s, _ in first)}), flush=True)
if sys.argv[1] == "sigterm":
    end = time.monotonic() + 60
    while not term and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(1.0)  # pebble's status loop (0.1 s) has seen any worker that the signal ended
    again = pool.run(os.getpid, [()] * 8, 60.0)
    alive = [psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids]
    print(json.dumps({"term": bool(term), "n_restarts": pool.n_restarts, "ok": all(s == "ok" for s, _ in again),
                      "alive": all(alive)}), flush=True)
    pool.close()
else:
    pool.run(time.sleep, [(600,)] * 2, 900.0)  # both workers busy when the owner is killed
"""


def _start_pool_owner(mode: str) -> tuple[subprocess.Popen, dict]:
    """A process (its own session, as a run under ``timeout``) that owns a 2-worker pool and has scored once."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-c", POOL_OWNER, mode], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    first = json.loads(p.stdout.readline() or "{}")
    assert first.get("ok") and len(first["pids"]) >= 3, first  # resource tracker, forkserver, >= 1 worker
    return p, first


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_pool_processes_survive_a_group_sigterm():
    """SIGTERM to the owner's whole process group: the owner (which handles it) scores again in the same pool with
    no rebuild, its resource tracker, forkserver and workers all still alive."""
    p, first = _start_pool_owner("sigterm")
    try:
        os.killpg(p.pid, signal.SIGTERM)
        out = json.loads(p.stdout.readline() or "{}")
        assert p.wait(timeout=120) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert out == {"term": True, "n_restarts": 0, "ok": True, "alive": True}, (out, first)


def test_sigkilled_owner_leaves_no_pool_process():
    """SIGKILL of the pool's owner (no cleanup runs) while both workers are inside a 600 s item: the forkserver
    sees its "alive" pipe close and exits, the busy workers die with it (PR_SET_PDEATHSIG; before, they ran their
    item to the end), the resource tracker exits at EOF: every pool process is gone within 15 s."""
    p, first = _start_pool_owner("sigkill")
    pids = first["pids"]
    time.sleep(2.0)  # the two sleep items reach the workers
    assert not any(_gone(pid) for pid in pids)
    p.kill()
    p.wait(timeout=30)
    end = time.monotonic() + 15
    while not all(_gone(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    left = [pid for pid in pids if not _gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, [psutil.Process(x).cmdline() for x in left if psutil.pid_exists(x)]
