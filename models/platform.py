"""The platform a program is built for: the devices of its mesh, not the host's default backend.

A program compiled ahead of time for a TPU slice or a GPU node (``stapo-jax plan --target``) is traced on a CPU
host: ``jax.default_backend()`` is ``"cpu"`` there, while the mesh holds the target's devices (the real
compiler's topology devices, ``jax.experimental.topologies``). Every choice made by platform while tracing
(attention kernel, cache write form, layer-scan unroll, decode kernel layout) reads :func:`mesh_platform`, so the
traced program is the one the target runs. Without a mesh it is the default backend, as before.
"""
from __future__ import annotations

from typing import Any, Optional

import jax

_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def _normalize(platform: str) -> str:
    p = str(platform).lower()
    return _ALIASES.get(p, p)


def mesh_platform(mesh: Optional[Any] = None) -> str:
    """``"cpu"``, ``"gpu"`` or ``"tpu"``: the platform of ``mesh``'s devices.

    Args:
      mesh: a ``jax.sharding.Mesh`` (its first device's ``platform``), an ``AbstractMesh`` (its
        ``abstract_device.platform``, present when it was made from a concrete mesh), or None: the mesh set with
        ``jax.set_mesh`` (the abstract mesh a trace sees), else ``jax.default_backend()``.
    Returns:
      the platform name, ``cuda`` / ``rocm`` reported as ``gpu``.
    Raises nothing: a mesh without device information falls back to ``jax.default_backend()``.
    Source: ``jax.sharding.AbstractMesh.abstract_device`` (JAX >= 0.7); MaxText picks kernels from the mesh's
    device kind the same way.
    """
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or getattr(mesh, "empty", True):
            return _normalize(jax.default_backend())
    devices = None
    try:
        devices = mesh.devices
    except (AttributeError, ValueError, NotImplementedError):  # AbstractMesh: "does not implement devices"
        devices = None
    if devices is not None and getattr(devices, "size", 0):
        return _normalize(devices.flat[0].platform)
    abstract = getattr(mesh, "abstract_device", None)
    if abstract is not None and getattr(abstract, "platform", None):
        return _normalize(abstract.platform)
    return _normalize(jax.default_backend())
