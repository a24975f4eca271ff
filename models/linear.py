"""A bias-free linear layer whose kernel can be held transposed for cached decoding (split from ``qwen3.py``).

Flax ``nnx.Linear`` stores ``kernel`` [in, out]; PyTorch ``nn.Linear`` stores ``weight`` [out, in]. For the skinny
products of a decode step (a few dozen rows against a weight matrix that does not fit in cache) XLA:CPU reads the
weight about twice as fast when it is [out, in] and contracted on its last axis (bench/bench_rollout.py), so the
rollout engine's per-layer decode copy may hold the kernels that way while every other user sees [in, out].
"""
from __future__ import annotations

from flax import nnx

KERNEL_LAYOUTS = ("in_out", "out_in")


def check_kernel_layout(layout: str) -> None:
    """Raise ValueError (naming ``kernel_layout``) unless ``layout`` is one of ``KERNEL_LAYOUTS``. No arrays.
    Source: the layout names of :class:`Linear` (PyTorch ``nn.Linear`` is ``"out_in"``)."""
    if layout not in KERNEL_LAYOUTS:
        raise ValueError(f"kernel_layout must be one of {KERNEL_LAYOUTS}, got {layout!r}")


class Linear(nnx.Linear):
    """``nnx.Linear`` (no bias) whose kernel may be held transposed for cached decoding.

    The parameter is always ``kernel`` [in, out] (``kernel_layout = "in_out"``: checkpoints, the trainer, the HF
    mapping of :mod:`models.hf`). The rollout engine's per-layer decode copy may hold it as [out, in]
    (``"out_in"``, PyTorch ``nn.Linear``'s layout; :func:`set_kernel_layout` marks the merged modules): on XLA:CPU
    a [32, 1024] x [1024, 3072] product then reads the weight about 2x faster (bench/bench_rollout.py).
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

    Mutates the (freshly merged) modules in place; no arrays are read or written (any dtype), so the caller must
    hold kernels of that layout. Raises ValueError for an unknown layout. Source: PyTorch ``nn.Linear`` stores
    ``weight`` [out, in]; Flax ``nnx.Linear`` ``kernel`` [in, out].
    """
    check_kernel_layout(layout)
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, Linear):
            sub.kernel_layout = layout


def preferred_kernel_layout(platform: str) -> str:
    """The decode kernel layout for a JAX platform name (``jax.default_backend()`` / ``device.platform``):
    ``"out_in"`` on ``"cpu"`` (measured: bench/bench_rollout.py), ``"in_out"`` elsewhere (GPU/TPU matmuls take
    either operand order; no transpose at weight sync). No arrays; never raises. Source: our measurement, the
    [out, in] kernel is PyTorch's ``nn.Linear`` convention."""
    return "out_in" if platform == "cpu" else "in_out"
