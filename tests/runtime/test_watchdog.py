"""The stall watchdog (stapo_jax/runtime/watchdog.py, issue 34 item 4), in-process: it fires with the phase and
every thread's stack when nothing marks progress for the timeout, stays quiet while progress is marked, is inert at
0, and the config key is validated. The multi-process injected hang and the restart are in
tests/runtime/test_run_robustness.py."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stapo_jax.config.schema import load_config
from stapo_jax.core.errors import ConfigError
from stapo_jax.runtime import watchdog
from stapo_jax.runtime.watchdog import EXIT_STALL, StallWatchdog, parse_hang, resolve_timeout


def _blocked_helper(ev: threading.Event) -> None:
    ev.wait(30)


def test_fires_with_phase_and_all_thread_stacks(tmp_path):
    codes = []
    ev = threading.Event()
    helper = threading.Thread(target=_blocked_helper, args=(ev,), daemon=True)
    helper.start()
    log = tmp_path / "p1.log"
    with open(log, "w") as f:
        wd = StallWatchdog(0.5, process_index=1, stream=f, exit_fn=codes.append)
        with wd:
            watchdog.progress("reward", step=2)
            t0 = time.monotonic()
            while not codes and time.monotonic() - t0 < 10:
                time.sleep(0.05)
    ev.set()
    waited = time.monotonic() - t0
    text = log.read_text()
    assert codes == [EXIT_STALL] == [75] and wd.fired
    assert 0.5 <= waited < 3, waited
    assert "no progress for" in text and "phase 'reward' of RL step 2 on process 1" in text
    assert "(most recent call first)" in text and "_blocked_helper" in text  # the other thread's stack too
    assert text.count("Thread 0x") >= 2


def test_quiet_while_progress_is_marked_and_off_at_zero():
    codes = []
    with StallWatchdog(0.6, exit_fn=codes.append) as wd:
        for _ in range(20):  # 2 s of marks every 0.1 s
            watchdog.progress()
            time.sleep(0.1)
        assert codes == [] and not wd.fired and wd.idle_s() < 0.6
    watchdog.progress("after")  # detached: a no-op
    assert wd.phase != "after"
    with StallWatchdog(0, exit_fn=codes.append):
        time.sleep(0.3)
    assert codes == []


def test_timeout_defaults_hang_spec_and_config_key():
    assert resolve_timeout(None, "cpu") == 600 and resolve_timeout(None, "gpu") == 1800
    assert resolve_timeout(None, "tpu") == 1800 and resolve_timeout(0, "cpu") == 0 and resolve_timeout(5, "gpu") == 5
    with pytest.raises(ValueError, match="stall_timeout_s"):
        resolve_timeout(-1, "cpu")
    assert parse_hang("1:reward:2") == (1, "reward", 2) and parse_hang("0:update") == (0, "update", None)
    assert parse_hang("") is None and parse_hang(None) is None
    for bad in ("x:reward", "1", "1::2", "1:reward:two"):
        with pytest.raises(ValueError, match="STAPO_TEST_HANG"):
            parse_hang(bad)
    assert load_config("configs/tiny_cpu.yaml").trainer.stall_timeout_s is None
    assert load_config("configs/tiny_cpu.yaml", ["trainer.stall_timeout_s=0"]).trainer.stall_timeout_s == 0
    with pytest.raises(ConfigError, match="trainer.stall_timeout_s=-5"):
        load_config("configs/tiny_cpu.yaml", ["trainer.stall_timeout_s=-5"])
    with pytest.raises(ConfigError, match="reward.max_pool_restarts=-1"):
        load_config("configs/tiny_cpu.yaml", ["reward.max_pool_restarts=-1"])


def test_exit_guard_ends_a_process_kept_alive_by_a_thread():
    code = ("import threading, time; from stapo_jax.runtime.watchdog import arm_exit_guard; "
            "threading.Thread(target=time.sleep, args=(600,)).start(); arm_exit_guard(3, 1.0); print('main done')")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 3 and time.monotonic() - t0 < 30, (r.returncode, r.stderr)
    assert "main done" in r.stdout and "still alive 1 s after the command ended" in r.stderr


def test_the_heartbeat_outlasts_the_watchdog_with_the_defaults():
    """Issue 43: with the defaults JAX's heartbeat (100 s) aborted a job whose peer stopped long before the
    watchdog (600 s on CPU) could name the stall. Now ``train`` asks for a heartbeat above limit + poll + grace."""
    from stapo_jax.runtime.distributed import resolve_heartbeat
    from stapo_jax.runtime.watchdog import GRACE_S, heartbeat_floor

    for stall, backend, limit in ((None, "cpu", 600), (None, "tpu", 1800), (None, None, 1800), (20, None, 20)):
        floor = heartbeat_floor(stall, backend)
        assert floor >= limit + 1 + GRACE_S + 10, (stall, backend, floor)
        assert resolve_heartbeat(None, floor) == max(100, floor)  # the default heartbeat follows the watchdog
    assert heartbeat_floor(0) is None and resolve_heartbeat(None, None) == 100
    assert resolve_heartbeat(10, heartbeat_floor(None, "cpu")) == 10  # an explicit setting is kept (with a warning)


STOPPED_PEER = """
import os, sys, time
from stapo_jax.runtime.distributed import initialize
from stapo_jax.runtime.watchdog import StallWatchdog, heartbeat_floor, progress
stall = float(sys.argv[1])
initialize(min_heartbeat_s=heartbeat_floor(stall))   # no heartbeat setting: the default the trainer gets
from stapo_jax.runtime.collectives import allgather_max
import jax
with StallWatchdog(stall, process_index=jax.process_index()):
    for step in range(1, 100000):
        progress("rollout", step)
        allgather_max(1.0)                           # a collective per step, as the RL loop's
        if step == 5:
            print("ready", jax.process_index(), os.getpid(), flush=True)
        time.sleep(0.05)
"""


@pytest.mark.parametrize("stopped", [0, 1])
def test_kill_stop_of_either_process_ends_with_the_watchdog_not_a_heartbeat_abort(stopped):
    """``kill -STOP`` of process ``stopped`` of a 2-process launch (no heartbeat setting): the other process's
    watchdog names the stall (its process, phase, step) with every thread's stack and exits 75, the launcher
    reports that process and exits 75 (resumable); no C++ check failure from JAX's heartbeat."""
    stall = 6
    env = {k: v for k, v in os.environ.items() if k != "STAPO_DISTRIBUTED_HEARTBEAT_TIMEOUT_S"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[2]), JAX_PLATFORMS="cpu")
    launcher = ("import sys; from stapo_jax.runtime.launch import launch_local; "
                "sys.exit(launch_local(2, ['-c', sys.argv[1], sys.argv[2]], devices=1, kill_after_s=5, timeout_s=150, "
                "module=None))")
    proc = subprocess.Popen([sys.executable, "-c", launcher, STOPPED_PEER, str(stall)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines, pids = [], {}
    try:
        while len(pids) < 2:
            line = proc.stdout.readline()
            assert line, "".join(lines)[-3000:]
            lines.append(line)
            if " ready " in line:
                pids[int(line.split()[2])] = int(line.split()[3])
        os.kill(pids[stopped], 19)  # SIGSTOP
        t0 = time.monotonic()
        text = "".join(lines) + proc.communicate(timeout=120)[0]
        took = time.monotonic() - t0
    finally:
        proc.kill()
        for pid in pids.values():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    other = 1 - stopped
    print(f"stopped process {stopped}: the launcher exited {proc.returncode} after {took:.1f} s")
    assert proc.returncode == EXIT_STALL, text[-3000:]
    line = next((x for x in text.splitlines() if "stall watchdog: no progress for" in x), text[-3000:])
    assert line.startswith(f"[p{other}] stall watchdog:") and f"in phase 'rollout' of RL step" in line, line
    assert f"on process {other};" in line, line
    assert f"[p{other}] Thread 0x" in text and "(most recent call first)" in text, text[-3000:]  # the stacks
    assert f"[launch] process {other} exited with 75 (the stall watchdog: resumable)" in text, text[-3000:]
    assert "Check failure" not in text and "heartbeat" not in text.lower(), text[-3000:]
    assert took < stall + 40, took
