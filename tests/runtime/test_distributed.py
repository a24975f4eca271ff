"""stapo_jax.runtime.distributed: settings validation, cluster detection, and a 2-process ``jax.distributed`` run on
127.0.0.1 (CPU, 2 devices per process) of three STAPO updates of a tiny Qwen3 (``stapo_jax.train.train_step``) that
must equal the single-process run on the same 4-device mesh (parameters within 1e-6, metrics within 1e-5)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import portpicker
import pytest

from stapo_jax.runtime import distributed
from xla_env import xla_flags

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed_worker.py"


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_", "OMPI_"))}
    env.update({"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "STAPO_DISTRIBUTED": "auto", **extra})
    return env


def test_two_processes_equal_one_process(tmp_path):
    port = portpicker.pick_unused_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "two.npz")], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(XLA_FLAGS=xla_flags(2),
                                       JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(x[-3000:] for x in logs)
    single = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "one.npz")], cwd=REPO, text=True,
                            capture_output=True, timeout=600,
                            env=_env(XLA_FLAGS=xla_flags(4)))
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert int(one["process_count"]) == 1 and int(two["process_count"]) == 2
    assert int(one["device_count"]) == int(two["device_count"]) == 4
    # the S2T mask was active (the global tau_h quantile spans both processes' rows) and training moved the loss
    assert 0 < one["metric/s2t/n_keep"].min() and one["metric/s2t/n_keep"].max() < int(one["valid_tokens"])
    assert len(set(np.round(one["metric/loss"], 4))) == 3
    for k in (k for k in one.files if k.startswith("metric/")):
        np.testing.assert_allclose(two[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)
    keys = sorted(k for k in one.files if k.startswith("param"))
    assert keys == sorted(k for k in two.files if k.startswith("param")) and len(keys) >= 10
    for k in keys:
        np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-6, err_msg=k)


def _worker_run(tmp_path, name: str, n: int, devices: int, **env) -> np.lib.npyio.NpzFile:
    """Run the worker as ``n`` processes x ``devices`` through ``jax.distributed`` (also for n = 1, as the launcher
    does: the same gloo all-reduce in every layout); returns process 0's npz."""
    port = portpicker.pick_unused_port()
    out = tmp_path / f"{name}.npz"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=_env(XLA_FLAGS=xla_flags(devices), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                                       JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i), STAPO_DISTRIBUTED="on",
                                       **env))
             for i in range(n)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * n, "\n\n".join(x[-3000:] for x in logs)
    return np.load(out)


# measured bound of 2 x 2 against 1 x 4 on the fsdp x tensor mesh (README, "Multi-process runs and pods")
FSDP_TENSOR_ATOL = 1e-5


def test_fsdp_by_tensor_mesh_two_processes_within_the_stated_bound(tmp_path):
    """Issue 43: on ``mesh.fsdp=2 mesh.tensor=2`` 2 x 2 processes differed from 1 x 4 by 2.16e-5 after ``train``,
    above README's 1e-5 (a data-parallel figure). The tensor axis splits a matmul's contraction over devices,
    and which devices share a process changes how gloo and XLA:CPU sum the partial products. Three STAPO updates
    here; README states the bound per mesh."""
    one = _worker_run(tmp_path, "one", 1, 4, STAPO_TEST_MESH="1,2,2")
    two = _worker_run(tmp_path, "two", 2, 2, STAPO_TEST_MESH="1,2,2")
    keys = sorted(k for k in one.files if k.startswith("param"))
    assert keys == sorted(k for k in two.files if k.startswith("param")) and len(keys) >= 10
    worst = max(float(np.abs(two[k] - one[k]).max()) for k in keys)
    print(f"fsdp x tensor mesh, 3 updates: 2 x 2 vs 1 x 4 max |diff| = {worst:.3g}")
    assert len(set(np.round(one["metric/loss"], 4))) == 3  # the updates moved the parameters
    assert worst <= FSDP_TENSOR_ATOL, worst


def test_detect_cluster():
    assert distributed.detect_cluster({}) is None
    assert distributed.detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert distributed.detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}) == "slurm"
    assert distributed.detect_cluster({"OMPI_COMM_WORLD_SIZE": "4"}) == "ompi"
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "t1v-0"}) is None
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1,t1v-2"}) == "tpu"


def test_single_process_is_a_noop(monkeypatch):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID", "SLURM_NTASKS",
              "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "STAPO_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    info = distributed.initialize()
    assert (info.method, info.process_index, info.process_count, info.is_coordinator) == ("single", 0, 1, True)
    assert info.device_count == info.local_device_count >= 1
    # one explicit process needs no coordination either
    assert distributed.initialize("127.0.0.1:1234", 1, 0).method == "single"
    assert distributed.initialize(mode="off").method == "single"


@pytest.mark.parametrize("kwargs,env,match", [
    ({"coordinator_address": "127.0.0.1:1"}, {}, r"missing \['num_processes"),
    ({"num_processes": 2, "process_id": 0}, {}, r"missing \['coordinator_address"),
    ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES='two' is not an integer"),
    ({"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": 2}, {}, r"process_id=2 must lie"),
    ({"coordinator_address": "127.0.0.1:1", "num_processes": 0, "process_id": 0}, {}, "num_processes=0"),
    ({"coordinator_address": "localhost", "num_processes": 2, "process_id": 0}, {}, "must be host:port"),
    ({"mode": "yes"}, {}, "distributed mode 'yes'"),
])
def test_bad_settings(monkeypatch, kwargs, env, match):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "STAPO_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(distributed.DistributedError, match=match):
        distributed.initialize(**kwargs)
