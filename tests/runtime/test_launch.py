"""stapo-jax launch --local: environment of each process, prefixed output, and failure handling (a failing
process stops the others within the grace period and the launcher returns its exit code)."""
import io
import time

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
    assert "[p0] hello 0" in text and "[p1] hello 1" in text and "a process exited with 7" in text


def test_a_process_killed_by_a_signal_gives_128_plus_the_signal():
    """kill -9 of one process: the launcher exits 137 (128 + SIGKILL, as a shell reports it), not the raw -9
    (which ``sys.exit`` would turn into 247)."""
    code = ("import os, signal, time; i = int(os.environ['JAX_PROCESS_ID']);"
            " os.kill(os.getpid(), signal.SIGKILL) if i == 1 else time.sleep(60)")
    out = io.StringIO()
    assert launch.launch_local(2, ["-c", code], kill_after_s=5, out=out, module=None) == 137
    assert "a process exited with 137" in out.getvalue()
    assert [launch.shell_exit_code(c) for c in (-15, 0, 3)] == [143, 0, 3]
