"""Mesh construction, parameter partition rules and activation sharding constraints.

Logical activation axes (``"batch"``, ``"heads"``, ``"mlp"``, ``"vocab"``) map onto the named mesh axes
``data``, ``fsdp`` and ``tensor``; :func:`constrain` is a no-op when no mesh is active, so model code runs
unchanged on one device.
"""
from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical activation axis -> mesh axes (Tunix/MaxText style logical rules)
LOGICAL_AXES = {
    "batch": ("data", "fsdp"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    None: None,
}


def _active_axis_names() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    return tuple(mesh.axis_names)


def logical_to_spec(axes: Sequence[str | None], mesh_axis_names: Sequence[str]) -> P:
    """Map logical axis names to a PartitionSpec over the mesh axes that exist.

    Args:
      axes: one logical name (or None) per array dimension, e.g. ``("batch", None, "heads")``.
      mesh_axis_names: the axis names of the active mesh.
    Returns:
      A ``PartitionSpec`` with one entry per dimension; mesh axes absent from the mesh are dropped.
    Raises:
      KeyError: an unknown logical axis name.
    """
    out = []
    for a in axes:
        if a is not None and a not in LOGICAL_AXES:
            raise KeyError(f"unknown logical axis {a!r}; known: {sorted(k for k in LOGICAL_AXES if k)}")
        m = LOGICAL_AXES[a]
        if m is None:
            out.append(None)
        elif isinstance(m, tuple):
            present = tuple(x for x in m if x in mesh_axis_names)
            out.append(present if present else None)
        else:
            out.append(m if m in mesh_axis_names else None)
    return P(*out)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Activation sharding constraint by logical axes; identity when no mesh is set (``jax.set_mesh``).

    Args:
      x: any array with ``len(axes)`` dimensions.
      axes: logical axis per dimension (see ``LOGICAL_AXES``).
    Returns:
      ``x``, constrained to the derived ``PartitionSpec`` when a mesh is active.
    """
    names = _active_axis_names()
    if not names:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, names))
