"""Compile targets of ``stapo-jax plan --target``: a TPU slice or GPU node whose real compiler runs on this host.

Each target names the chip, how many, and the facts a plan needs (HBM per chip, dense bf16 peak, HBM bandwidth).
Its devices come from the real compiler's topology description (``jax.experimental.topologies``), with no
accelerator present:

* **TPU**: libtpu (the version ``jax[tpu]`` pins for the installed jax) describes the slice
  (``get_topology_desc(platform="tpu", topology_name="v5p:4x4x2")``); ``.compile()`` runs the TPU compiler, and
  Pallas kernels (splash attention) compile through Mosaic for real.
* **GPU** (deviceless): the CUDA PJRT plugin with ptxas and libdevice (``nvidia-cuda-nvcc-cu12``) and cuDNN,
  given a ``GpuTargetConfigProto`` of the chip's published facts (:func:`gpu_target_config`); ``.compile()``
  writes sm_90a code. No autotuning happens (there is no GPU to time on), cuDNN workspaces count 0, and sorts
  take XLA's own kernel (``--xla_gpu_enable_cub_radix_sort=false``).

The packages live in ``requirements-targets.txt``; ``make setup-targets`` installs them into
``.venv/targets`` (kept apart from the run's environment, so nothing else sees libtpu or the CUDA plugin), which
the plan's compile subprocess puts on its path. A missing package is one error line naming the command.
"""
from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.metadata
import os
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
PACKAGES_ENV = "STAPO_JAX_TARGET_PACKAGES"  # a directory holding the target compilers' packages
DEFAULT_PACKAGES = REPO / ".venv" / "targets"
INSTALL_HINT = "make setup-targets (or: pip install --target .venv/targets --no-deps -r requirements-targets.txt)"


class TargetError(ValueError):
    """An unknown target, or one whose compiler packages are not installed (the message names the command)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One compile target: ``platform`` ``"tpu"`` / ``"gpu"``, the topology arguments of
    ``jax.experimental.topologies.get_topology_desc``, the chip count, and per-chip facts: ``hbm_gb`` (decimal GB),
    ``peak_flops`` (dense bf16 FLOP/s), ``hbm_bandwidth`` (bytes/s). Sources: Google Cloud TPU pages (v4, v5e, v5p,
    v6e), NVIDIA H100 SXM / H200 datasheets."""

    name: str
    platform: str
    topology_name: str
    chips: int
    chip: str
    hbm_gb: float
    peak_flops: float
    hbm_bandwidth: float
    topology: Optional[str] = None      # GPU: "<slices>x<hosts>x<devices per host>"
    hosts: int = 1
    host_topology: Optional[str] = None  # one host's devices (the rollout engine's mesh in a multi-host job)


_TPU = dict(platform="tpu")
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("tpu-v5e-4", topology_name="v5e:2x2", chips=4, chip="TPU v5e", hbm_gb=16.0, peak_flops=197e12,
           hbm_bandwidth=819e9, **_TPU),
    # v4: libtpu's topology describes each TensorCore as a device (2 per chip): 32 devices of half a chip
    Target("tpu-v4-32", topology_name="v4:2x2x4", chips=32, chip="TPU v4 (per TensorCore)", hbm_gb=16.0,
           peak_flops=137.5e12, hbm_bandwidth=614e9, hosts=4, host_topology="v4:2x2x1", **_TPU),
    Target("tpu-v5p-64", topology_name="v5p:4x4x2", chips=32, chip="TPU v5p", hbm_gb=95.0, peak_flops=459e12,
           hbm_bandwidth=2765e9, hosts=8, host_topology="v5p:2x2x1", **_TPU),
    Target("tpu-v6e-64", topology_name="v6e:8x8", chips=64, chip="TPU v6e", hbm_gb=32.0, peak_flops=918e12,
           hbm_bandwidth=1640e9, hosts=16, host_topology="v6e:2x2", **_TPU),
    Target("tpu-v5e-256", topology_name="v5e:16x16", chips=256, chip="TPU v5e", hbm_gb=16.0, peak_flops=197e12,
           hbm_bandwidth=819e9, hosts=64, host_topology="v5e:2x2", **_TPU),
    Target("gpu-2xh100", platform="gpu", topology_name="h100", topology="1x1x2", chips=2, chip="NVIDIA H100",
           hbm_gb=80.0, peak_flops=989.4e12, hbm_bandwidth=3.35e12),
    Target("gpu-8xh100", platform="gpu", topology_name="h100", topology="1x1x8", chips=8, chip="NVIDIA H100",
           hbm_gb=80.0, peak_flops=989.4e12, hbm_bandwidth=3.35e12),
    Target("gpu-8xh200", platform="gpu", topology_name="h200", topology="1x1x8", chips=8, chip="NVIDIA H200",
           hbm_gb=141.0, peak_flops=989.4e12, hbm_bandwidth=4.8e12),
    Target("gpu-2x8xh100", platform="gpu", topology_name="h100", topology="1x2x8", chips=16, chip="NVIDIA H100",
           hbm_gb=80.0, peak_flops=989.4e12, hbm_bandwidth=3.35e12, hosts=2, host_topology="1x1x8"),
)}

# Published facts of the GPU chips (NVIDIA datasheets; SM count, memory, L2, clocks of the SXM parts):
# (device name, SMs, memory bytes, memory bandwidth bytes/s, L2 bytes, boost clock GHz)
_GPU_CHIPS = {
    "h100": ("NVIDIA H100 80GB HBM3", 132, 84_942_979_072, 3_352_320_000_000, 52_428_800, 1.98),
    "h200": ("NVIDIA H200 141GB HBM3e", 132, 151_397_597_184, 4_800_000_000_000, 52_428_800, 1.98),
}


def get_target(name: str) -> Target:
    """The :class:`Target` called ``name`` (a key of :data:`TARGETS`). Raises TargetError naming the known
    targets. Takes and returns plain values (str in). Source: this module's table."""
    try:
        return TARGETS[name]
    except KeyError:
        raise TargetError(f"--target {name!r}: unknown target; expected one of {sorted(TARGETS)}") from None


def gpu_target_config(topology_name: str) -> str:
    """The ``stream_executor.GpuTargetConfigProto`` text of a Hopper GPU (``"h100"`` / ``"h200"``): compute
    capability 9.0, SM count, shared memory per block / SM, memory size and bandwidth, L2, clock and the cuDNN
    version of ``nvidia-cudnn-cu12`` 9.x. Returns a str; raises TargetError for another chip. Source: NVIDIA's
    Hopper tuning guide and datasheets; the fields of XLA's ``GpuTargetConfigProto``."""
    if topology_name not in _GPU_CHIPS:
        raise TargetError(f"no GPU target config for {topology_name!r} (known: {sorted(_GPU_CHIPS)})")
    name, sms, mem, bw, l2, ghz = _GPU_CHIPS[topology_name]
    return (
        "gpu_device_info {\n"
        "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n  shared_memory_per_block: 49152\n"
        "  shared_memory_per_core: 233472\n  threads_per_core_limit: 2048\n"
        f"  core_count: {sms}\n  fpus_per_core: 128\n"
        "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n  block_dim_limit_z: 65535\n"
        f"  memory_bandwidth: {bw}\n  l2_cache_size: {l2}\n  clock_rate_ghz: {ghz}\n"
        f"  device_memory_size: {mem}\n  shared_memory_per_block_optin: 232448\n"
        "  cuda_compute_capability { major: 9 minor: 0 }\n"
        "  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n}\n"
        'platform_name: "CUDA"\n'
        "dnn_version_info { major: 9 minor: 8 patch: 0 }\n"
        f'device_description_str: "{name}"\n')


def packages_dir() -> Path:
    """Where the target compilers' packages are looked for besides the interpreter's own path:
    ``$STAPO_JAX_TARGET_PACKAGES`` or ``.venv/targets`` of the repository. Returns a Path (it may not exist);
    never raises. Source: pip's ``--target`` install layout."""
    return Path(os.environ.get(PACKAGES_ENV) or DEFAULT_PACKAGES)


def _required(target: Target) -> tuple[str, ...]:
    # import names each platform's compile needs (the CUDA plugin registers through jax_plugins)
    return ("libtpu",) if target.platform == "tpu" else ("jax_plugins", "jax_cuda12_plugin", "nvidia")


def check_packages(target: Target) -> None:
    """Raise TargetError (one line: the missing module and :data:`INSTALL_HINT`) unless the compiler packages of
    ``target`` import, from this interpreter's path or :func:`packages_dir`. Returns None; reads only file
    metadata (nothing is imported). Source: ``importlib.machinery.PathFinder``."""
    import sys

    search = [str(packages_dir())] + sys.path
    for module in _required(target):
        if importlib.machinery.PathFinder.find_spec(module, search) is None:
            raise TargetError(f"--target {target.name} needs the {target.platform.upper()} compiler packages "
                              f"(module {module!r} not found): run {INSTALL_HINT}")


def compiler_version(target: Target) -> str:
    """The compiler that produces the target's figures, with versions: ``"libtpu 0.0.42.1 (jax 0.10.2)"`` or
    ``"XLA GPU (jax-cuda12-plugin 0.10.2, nvcc 12.9.86, cuDNN 9.28.0.42)"``. Returns a str ("?" for a version
    not found); never raises. Source: ``importlib.metadata`` of the installed distributions."""
    import sys

    path = [str(packages_dir())] + sys.path

    def version(dist: str) -> str:
        for d in importlib.metadata.distributions(path=path, name=dist):
            return d.version
        return "?"

    jax_v = version("jax")
    if target.platform == "tpu":
        return f"libtpu {version('libtpu')} (jax {jax_v})"
    return (f"XLA GPU, deviceless (jax-cuda12-plugin {version('jax-cuda12-plugin')}, nvcc "
            f"{version('nvidia-cuda-nvcc-cu12')}, cuDNN {version('nvidia-cudnn-cu12')}; jax {jax_v})")


def target_environment(target: Target, env: dict) -> dict:
    """``env`` for the compile subprocess of ``target``: the packages directory on ``PYTHONPATH``,
    ``JAX_PLATFORMS=cpu`` (the host runs nothing on the target), libtpu's metadata probing and single-process
    lockfile off (TPU), and XLA's
    own sort kernel (GPU: CUB's radix sort needs a device to size its scratch). Returns a new dict of str; never
    raises. Source: libtpu's ``TPU_SKIP_MDS_QUERY``; jax's ``tests/deviceless_aot_test.py``."""
    out = dict(env)
    extra = packages_dir()
    if extra.is_dir():
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra), out.get("PYTHONPATH", "")) if p)
    out["JAX_PLATFORMS"] = "cpu"
    flags = [f for f in out.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if target.platform == "tpu":
        # no metadata server here; several compiles at once (no chip is opened, so libtpu's lockfile is moot)
        out.update(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE="v5e-4", TPU_WORKER_HOSTNAMES="localhost",
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    else:
        flags.append("--xla_gpu_enable_cub_radix_sort=false")
    out["XLA_FLAGS"] = " ".join(flags)
    return out


def target_devices(target: Target, host: bool = False) -> list:
    """The target's devices from its real compiler's topology (``jax.experimental.topologies``; no accelerator
    needed): ``target.chips`` TPU or GPU device objects a ``Mesh`` can be built on, for ``jit(...).lower(...)
    .compile()``; with ``host``, one host's devices as a topology of their own (``target.host_topology``: a
    program over part of a slice must be compiled for that part, the compiler numbers its devices from 0).
    Runs in the compile subprocess (:func:`target_environment`). Raises TargetError when the topology cannot be
    made (the compiler's message attached). Source: ``get_topology_desc``."""
    from jax.experimental import topologies

    name = target.topology_name
    try:
        if target.platform == "tpu":
            topo = topologies.get_topology_desc(platform="tpu", topology_name=(target.host_topology if host
                                                                               else name))
        else:
            topo = topologies.get_topology_desc(platform="cuda", topology_name=name,
                                                topology=target.host_topology if host else target.topology,
                                                target_config=gpu_target_config(name))
    except Exception as e:  # the plugin's own error types differ by version
        raise TargetError(f"--target {target.name}: the {target.platform.upper()} compiler could not describe "
                          f"{name} ({type(e).__name__}: {e}); {INSTALL_HINT}") from e
    devices = list(topo.devices)
    want = target.chips // max(target.hosts, 1) if host else target.chips
    if len(devices) != want:
        raise TargetError(f"--target {target.name}: topology {name} has {len(devices)} devices, expected {want}")
    return devices
