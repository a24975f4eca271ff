"""Dense matmul peak FLOP/s per chip, for model-FLOPs utilisation (MFU).

Vendor figures, dense (no 2:4 sparsity), per chip:

- TPU v4: 275 TFLOP/s bf16 (cloud.google.com/tpu/docs/v4). TPU v5e: 197 (cloud.google.com/tpu/docs/v5e).
  TPU v5p: 459 (cloud.google.com/tpu/docs/v5p). TPU v6e (Trillium): 918 (cloud.google.com/tpu/docs/v6e).
  fp32: XLA on TPU runs float32 matmuls at the default precision as bf16 MXU passes, so the bf16 figure.
- NVIDIA A100 SXM: 312 bf16, 156 TF32 (NVIDIA A100 datasheet). H100 SXM: 989.4 bf16, 494.7 TF32 (NVIDIA H100
  datasheet, half the "with sparsity" figures). H200: the H100's tensor cores, 989.4 bf16, 494.7 TF32 (NVIDIA H200
  datasheet). fp32: XLA on GPU runs float32 matmuls at the default precision on TF32 tensor cores.
- CPU (fallback): measured, the best of a few float32 1024^3 matmuls on the host (all its cores), both dtypes;
  a nominal figure would say nothing about a shared or throttled machine.
"""
from __future__ import annotations

import time
from typing import Optional

import jax
import jax.numpy as jnp

# (substring of jax's device_kind, lower case; name; bf16 FLOP/s; fp32 FLOP/s) - first match wins
PEAKS = (
    ("v6 lite", "TPU v6e", 918e12, 918e12),
    ("v6e", "TPU v6e", 918e12, 918e12),
    ("v5 lite", "TPU v5e", 197e12, 197e12),
    ("v5e", "TPU v5e", 197e12, 197e12),
    ("v5p", "TPU v5p", 459e12, 459e12),
    ("tpu v5", "TPU v5p", 459e12, 459e12),
    ("tpu v4", "TPU v4", 275e12, 275e12),
    ("h200", "NVIDIA H200", 989.4e12, 494.7e12),
    ("h100", "NVIDIA H100", 989.4e12, 494.7e12),
    ("a100", "NVIDIA A100", 312e12, 156e12),
)


def chip_peak(device_kind: str, dtype: str) -> Optional[tuple[str, float]]:
    """``(chip name, dense peak FLOP/s)`` of one chip for ``device_kind`` (``jax.Device.device_kind``, e.g.
    ``"NVIDIA H200"``, ``"TPU v5 lite"``) at compute ``dtype`` (``bfloat16`` / ``float16``: the bf16 figure;
    otherwise fp32), or None for a chip not in the table. Takes str; never raises. Source: the vendor figures
    in this module's docstring."""
    kind = str(device_kind).lower()
    for key, name, bf16, fp32 in PEAKS:
        if key in kind:
            return name, (bf16 if dtype in ("bfloat16", "float16") else fp32)
    return None


def measured_cpu_peak(n: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of the best of ``repeats`` float32 ``[n, n] @ [n, n]`` matmuls on the default device (2 n^3 FLOPs
    each, after one warm-up call). Returns a float (FLOP/s); never raises for n >= 1. Source: the usual
    measured-roofline practice for hosts without a vendor peak."""
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / max(best, 1e-9)


def device_peak(dtype: str) -> dict:
    """The peak of the run's chips: ``{"chip", "peak_flops" (per chip, FLOP/s), "devices", "source"}`` from
    :data:`PEAKS` for jax's first device, else (CPU, unknown accelerators) :func:`measured_cpu_peak` with
    ``devices`` 1 (simulated CPU devices share the host's cores). Takes the compute dtype (str);
    returns float / int / str values; never raises.
    Source: the vendor figures in this module's docstring."""
    dev = jax.devices()[0]
    found = chip_peak(dev.device_kind, dtype)
    if found is not None:
        return {"chip": found[0], "peak_flops": found[1], "devices": jax.device_count(), "source": "table"}
    return {"chip": f"{dev.platform}: {dev.device_kind}", "peak_flops": measured_cpu_peak(), "devices": 1,
            "source": "measured float32 matmul"}
