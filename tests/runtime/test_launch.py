"""stapo-jax launch --local: environment of each process, prefixed output, and failure handling (a failing
process stops the others within the grace period and the launcher returns its exit code, naming the process);
issue 43: one progress bar, launcher flag typos caught by launch, Ctrl-C = SIGTERM (a second one stops at once,
130), and processes that stop when their launcher is killed."""
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stapo_jax.runtime import launch


def test_process_env_sets_coordinates_and_devices():
    env = launch.process_env(1, 4, 12345, 3, base={"JAX_PROCESS_ID": "9", "SLURM_NTASKS": "8",
                                                   "XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"})
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:12345"
    assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("4", "1")
    assert launch.process_env(0, 1, 12345, 4, base={"STAPO_DISTRIBUTED": "auto"})["STAPO_DISTRIBUTED"] == "on"
    assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=3"
    assert "SLURM_NTASKS" not in env


def test_failure_stops_the_others_and_is_returned():
    # the stand-in "stapo-jax" command: process 1 fails at once, process 0 would sleep for a minute
    code = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); print('hello', i, flush=True);"
            " sys.exit(7) if i == 1 else time.sleep(60)")
    out = io.StringIO()
    t0 = time.monotonic()
    rc = launch.launch_local(2, ["-c", code], kill_after_s=5, out=out, module=None)
    assert rc == 7 and time.monotonic() - t0 < 30
    text = out.getvalue()
    assert "[p0] hello 0" in text and "[p1] hello 1" in text
    assert "[launch] process 1 exited with 7: stopping the others" in text  # issue 43: names the process


def test_a_process_killed_by_a_signal_gives_128_plus_the_signal():
    """kill -9 of one process: the launcher exits 137 (128 + SIGKILL, as a shell reports it), not the raw -9
    (which ``sys.exit`` would turn into 247)."""
    code = ("import os, signal, time; i = int(os.environ['JAX_PROCESS_ID']);"
            " os.kill(os.getpid(), signal.SIGKILL) if i == 1 else time.sleep(60)")
    out = io.StringIO()
    assert launch.launch_local(2, ["-c", code], kill_after_s=5, out=out, module=None) == 137
    assert "[launch] process 1 was killed by SIGKILL (exit 137)" in out.getvalue()
    assert [launch.shell_exit_code(c) for c in (-15, 0, 3)] == [143, 0, 3]


def test_a_progress_bar_is_one_bar_not_a_line_per_refresh():
    """tqdm redraws with carriage returns; the launcher used to print each refresh as its own ``[p0]`` line."""
    code = ("import sys, time; w = sys.stderr.write; w('start\\n');"
            " [w(f'\\rstep {k}/50') or sys.stderr.flush() for k in range(51)]; w('\\n'); w('done\\n')")
    out = io.StringIO()
    assert launch.launch_local(1, ["-c", code], kill_after_s=5, out=out, module=None) == 0
    assert out.getvalue().splitlines() == ["[p0] start", "[p0] step 50/50", "[p0] done"]


def test_a_mistyped_launcher_option_is_an_error_of_launch(capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--local", "2", "--devics-per-process", "2", "--config", "configs/tiny_cpu.yaml", "a.b=1"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.splitlines()[-1] == ("stapo-jax launch: error: unknown option --devics-per-process: did you mean "
                                    "--devices-per-process? (the options of `stapo-jax launch` come first; the rest "
                                    "goes to `stapo-jax train`)")


# a stand-in worker: stops like the trainer (runtime.stopping.Preemption), or records when its launcher is gone
WORKER = """
import os, sys, time
from stapo_jax.runtime.stopping import Preemption, watch_launcher_from_env
i, mode = int(os.environ["JAX_PROCESS_ID"]), sys.argv[1]
preempt = Preemption()
if mode == "orphan":
    watch_launcher_from_env()
print("ready", i, os.getpid(), flush=True)
deadline = time.monotonic() + 120
while time.monotonic() < deadline and not (preempt.requested and mode != "ignore"):
    time.sleep(0.05)
if mode == "orphan":
    open(sys.argv[2] + f".{i}.tmp", "w").write(f"{os.getpid()} stopped {time.monotonic()}")
    os.replace(sys.argv[2] + f".{i}.tmp", sys.argv[2] + f".{i}")  # whole, once it exists
print("checkpointed and stopped", i, flush=True)
"""
LAUNCHER = ("import sys; from stapo_jax.runtime.launch import launch_local; "
            "sys.exit(launch_local(2, sys.argv[1:], kill_after_s=10, module=None))")


def _launcher(tmp_path: Path, *args: str) -> subprocess.Popen:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(worker), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _wait_ready(proc: subprocess.Popen, n: int = 2) -> list[str]:
    lines = []
    while sum(line.startswith("[p") and " ready " in line for line in lines) < n:
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
    return lines


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_to_the_launcher_stops_the_job_like_sigterm(tmp_path, presses):
    """One SIGINT: every process gets SIGTERM, stops after its step and exits 0, and so does the launcher. Two: the
    processes stop at once (130) with one line each, no KeyboardInterrupt traceback."""
    proc = _launcher(tmp_path, "run" if presses == 1 else "ignore")
    try:
        lines = _wait_ready(proc)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        if presses == 2:
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        text = "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 30
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert "[launch] SIGINT: asking every process to checkpoint and stop (SIGTERM)" in text, text
    if presses == 1:
        assert proc.returncode == 0, text
        assert text.count("checkpointed and stopped") == 2 and text.count("SIGTERM: stopping after") == 2, text
    else:
        assert proc.returncode == 130, text
        assert "[launch] SIGINT: stopping every process now" in text and "checkpointed and" not in text, text
        assert text.count("second stop signal (SIGINT): stopping now without a checkpoint (exit 130)") == 2, text


def test_processes_stop_when_their_launcher_is_killed(tmp_path):
    """kill -9 of the launcher used to leave its processes running, unseen, until the heartbeat ended them."""
    mark = tmp_path / "stopped"
    proc = _launcher(tmp_path, "orphan", str(mark))
    pids = []
    try:
        ready = sorted(line.split()[-2:] for line in _wait_ready(proc) if " ready " in line)  # either may be first
        pids = [int(pid) for _, pid in ready]
        proc.kill()
        proc.wait(timeout=10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15 and not all(Path(f"{mark}.{i}").exists() for i in range(2)):
            time.sleep(0.1)
        waited = time.monotonic() - t0
    finally:
        for pid in pids:  # the stand-ins, should they still run
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(f"both processes stopped {waited:.1f} s after kill -9 of the launcher")
    assert waited < 5, waited
    assert [Path(f"{mark}.{i}").read_text().split()[:2] for i in range(2)] == [[str(p), "stopped"] for p in pids]


def test_the_job_stops_when_the_launchers_parent_exits(tmp_path):
    """A launcher whose parent dies (a test runner killed by `timeout`, a closed terminal) used to run its job
    until --timeout; it now stops every process as on a failure (SIGTERM: they checkpoint) and exits 129."""
    worker, log = tmp_path / "worker.py", tmp_path / "launcher.log"
    worker.write_text(WORKER)
    middle = ("import subprocess, sys, time\n"
              f"log = open({str(log)!r}, 'w')\n"
              f"p = subprocess.Popen([sys.executable, '-c', {LAUNCHER!r}, {str(worker)!r}, 'run'], stdout=log,\n"
              "                     stderr=subprocess.STDOUT)\n"
              "print(p.pid, flush=True)\n"
              f"while open({str(log)!r}).read().count(' ready ') < 2:\n"
              "    time.sleep(0.1)\n")  # then exits, leaving the launcher without its parent
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True, env=env, timeout=120)
    launcher = int(out.stdout.split()[0])
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30 and Path(f"/proc/{launcher}").exists() \
            and "zombie" not in Path(f"/proc/{launcher}/status").read_text().lower():
        time.sleep(0.1)
    waited = time.monotonic() - t0
    text = log.read_text()
    assert waited < 15, text
    assert "[launch] the launcher's parent" in text and "is gone: stopping every process" in text, text
    assert text.count("checkpointed and stopped") == 2, text
