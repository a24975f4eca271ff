"""A bias-free linear layer whose kernel can be held transposed for cached decoding (split from ``qwen3.py``).

Flax ``nnx.Linear`` stores ``kernel`` [in, out]; PyTorch ``nn.Linear`` stores ``weight`` [out, in]. For the skinny
products of a decode step (a few dozen rows against a weight matrix that does not fit in cache) XLA:CPU on an
Intel Xeon or an AVX2 AMD EPYC (Zen 3) reads the weight faster when it is [out, in] and contracted on its last
axis (on an AVX-512 AMD EPYC, Zen 4, the [in, out] form is faster; bench/bench_rollout.py), so the rollout
engine's per-layer decode copy may hold the kernels that way while every other user sees [in, out].
"""
from __future__ import annotations

from flax import nnx

KERNEL_LAYOUTS = ("in_out", "out_in")


def check_kernel_layout(layout: str) -> None:
    """Raise ValueError (naming ``kernel_layout``) unless ``layout`` is one of ``KERNEL_LAYOUTS``.
    Source: the layout names of :class:`Linear` (PyTorch ``nn.Linear`` is ``"out_in"``)."""
    if layout not in KERNEL_LAYOUTS:
        raise ValueError(f"kernel_layout must be one of {KERNEL_LAYOUTS}, got {layout!r}")


class Linear(nnx.Linear):
    """``nnx.Linear`` (no bias) whose kernel may be held transposed for cached decoding.

    The parameter is always ``kernel`` [in, out] (``kernel_layout = "in_out"``: checkpoints, the trainer, the HF
    mapping of :mod:`models.hf`). The rollout engine's per-layer decode copy may hold it as [out, in]
    (``"out_in"``, PyTorch ``nn.Linear``'s layout; :func:`set_kernel_layout` marks the merged modules): on XLA:CPU
    a [32, 1024] x [1024, 3072] product then reads the weight about 2x faster on an Intel Xeon
    (bench/bench_rollout.py; :func:`preferred_kernel_layout`).
    ``__call__(x [..., in]) -> [..., out]`` in ``dtype``, as ``nnx.Linear``; never raises for matching shapes.
    """

    kernel_layout = "in_out"  # class default; an instance attribute only on decode copies

    def __call__(self, x):
        if self.kernel_layout == "in_out":
            return super().__call__(x)
        # nnx.Linear's own steps (dtype promotion, its dot_general), contracting the kernel's last axis instead
        x, kernel, _ = self.promote_dtype((x, self.kernel[...], None), dtype=self.dtype)
        kw = {} if self.preferred_element_type is None else {"preferred_element_type": self.preferred_element_type}
        return self.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((), ())), precision=self.precision, **kw)


def set_kernel_layout(module: nnx.Module, layout: str) -> None:
    """Mark every :class:`Linear` inside ``module`` as holding its kernel in ``layout`` (``KERNEL_LAYOUTS``).

    Mutates the (freshly merged) modules in place; no weights are read or written (any dtype), so the caller must
    hold kernels of that layout. Raises ValueError for an unknown layout. Source: PyTorch ``nn.Linear`` stores
    ``weight`` [out, in]; Flax ``nnx.Linear`` ``kernel`` [in, out].
    """
    check_kernel_layout(layout)
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, Linear):
            sub.kernel_layout = layout


def cpuinfo_fields(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The ``key: value`` lines of the first processor block of ``cpuinfo`` as a dict of stripped strings (the
    first value of a repeated key wins); ``{}`` where the file cannot be read (not Linux). Never
    raises. Source: the Linux ``/proc/cpuinfo`` format."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, frozenset]:
    """The host CPU's vendor id (``"GenuineIntel"``, ``"AuthenticAMD"``, ...) and feature flags (``"avx2"``,
    ``"avx512f"``, ...) from :func:`cpuinfo_fields`; ``("", frozenset())`` where they cannot be read (not
    Linux, no such lines; a missing file is not an error). Source: the Linux ``/proc/cpuinfo`` format (x86 ``CPUID``
    vendor string and feature names)."""
    fields = cpuinfo_fields(cpuinfo)
    return fields.get("vendor_id", ""), frozenset(fields.get("flags", "").split())


def preferred_kernel_layout(platform: str, vendor: str | None = None, flags: frozenset | None = None) -> str:
    """The decode kernel layout for a JAX platform name (``jax.default_backend()`` / ``device.platform``), CPU
    vendor id and set of CPU feature flag names (each ``None``: this host's, :func:`cpu_info`): ``"in_out"``
    off CPU and on an AMD CPU with ``avx512f``, ``"out_in"`` on every other CPU.

    Measured with ``bench/bench_rollout.py --kernel-layouts in_out,out_in`` at Qwen3-0.6B, 32 slots, 2 cores: on
    an Intel Xeon (AVX-512) out_in made the layers' decode matmuls about 2x faster (400 -> 190 ms per step); on an
    AMD EPYC Zen 3 (AVX2) out_in made decoding 1.22x faster (29.5 -> 35.9 tok/s); on an AMD EPYC Zen 4 (AVX-512)
    in_out made the whole step faster (524 vs 665 ms). GPU/TPU matmuls take either operand order, and in_out
    needs no transpose at weight sync. Raises nothing: every platform / vendor / flag set gets a layout.
    Source: our measurements; [out, in] is PyTorch's ``nn.Linear`` convention."""
    if platform != "cpu":
        return "in_out"
    if vendor is None or flags is None:
        here_vendor, here_flags = cpu_info()
        vendor = here_vendor if vendor is None else vendor
        flags = here_flags if flags is None else flags
    return "in_out" if vendor == "AuthenticAMD" and "avx512f" in flags else "out_in"
