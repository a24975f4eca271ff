"""How many decoder layers one iteration of the uncached forward's layer scan runs (``Qwen3Config.scan_unroll``,
the run config's ``model.scan_unroll``).

The stacked ``[L, ...]`` layer parameters are applied with ``jax.lax.scan`` (compile time flat in depth, what
pod-scale models need). ``jax.lax.scan(unroll=k)`` runs ``k`` layers per loop iteration. On XLA:CPU that is
faster: every rolled iteration copies its layer's slice of the stacked weights out (forward, and again in the
remat backward) and writes its gradient back into the stack, and unrolling lets XLA fuse or skip some of those
copies. Measured with ``bench/bench_scan_layers.py --layers 28 --unrolls 2,4,7,14,28`` (Qwen3-0.6B widths,
1 x 512 tokens, loss + gradient, remat ``dots_no_batch``) on an AMD EPYC Zen 5 (AVX-512, 2 cores): see
``CPU_SCAN_UNROLL`` and docs/benchmarks.md. On GPU / TPU XLA fuses such dynamic slices into their consumers, so
``auto`` keeps the rolled loop there (not measured here: no accelerator was lent).
"""
from __future__ import annotations

from typing import Optional, Union

from models.platform import mesh_platform

CPU_SCAN_UNROLL = 4  # layers per scan iteration that ``auto`` picks on CPU (bench_scan_layers.py; docs/benchmarks.md)


def resolve_scan_unroll(value: Union[int, str], platform: Optional[str] = None) -> int:
    """``model.scan_unroll`` as the int ``jax.lax.scan(unroll=)`` takes: an int >= 1 is returned as is;
    ``"auto"`` gives :data:`CPU_SCAN_UNROLL` on the ``"cpu"`` platform and 1 (the rolled loop) on ``"gpu"`` /
    ``"tpu"`` (``platform`` defaults to the active mesh's, :func:`models.platform.mesh_platform`). Raises ValueError naming
    ``scan_unroll`` for anything else (0, a negative int, another string, a bool). Source: ``jax.lax.scan``'s
    ``unroll`` argument; MaxText's ``scan_layers`` keeps the rolled loop on accelerators."""
    if value == "auto" and isinstance(value, str):
        return CPU_SCAN_UNROLL if (platform or mesh_platform()) == "cpu" else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"scan_unroll must be 'auto' or an int >= 1 (layers per scan iteration), got {value!r}")
    return value
