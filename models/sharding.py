"""Mesh construction, parameter partition rules and activation sharding constraints.

Mesh axes are ``("data", "fsdp", "tensor")``:

* ``data``   pure data parallelism (parameters replicated),
* ``fsdp``   data parallelism with parameters sharded over their large (hidden) dimension (ZeRO-3 style),
* ``tensor`` tensor parallelism over attention heads, the MLP intermediate dimension and the vocabulary.

Parameters get *logical* axes from :data:`PARAM_RULES` (regexes over the dotted parameter path of
``models.qwen3.Qwen3``); logical axes map to mesh axes through :data:`PARAM_AXES` (parameters) or
:data:`LOGICAL_AXES` (activations). A mesh axis that does not divide an array dimension is dropped for that
dimension (replication), so any mesh works for any model size; only efficiency changes. The stacked layer
axis ``L`` is never sharded (``jax.lax.scan`` slices it). The explicit per-parameter PartitionSpecs follow
Tunix/MaxText logical-axis rules.

:func:`constrain` is a no-op when no mesh is active (``jax.set_mesh``), so model code runs unchanged on one
device.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping, Optional, Sequence

import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")


class ShardingError(ValueError):
    """A mesh that does not fit the devices, or a parameter without a partition rule."""


# logical activation axis -> mesh axes (Tunix/MaxText style logical rules)
LOGICAL_AXES = {
    "batch": ("data", "fsdp"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "tensor": "tensor",
    None: None,
}

# logical parameter axis -> mesh axes. "embed" is the FSDP (large, model-width) dimension.
PARAM_AXES = {
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    None: None,
}

# (regex over the dotted parameter path, logical axis per dimension). First match wins.
# Shapes follow the model contract: kernels are [in, out]; layer params carry a leading L axis.
PARAM_RULES: tuple[tuple[str, tuple[Optional[str], ...]], ...] = (
    (r"^embed_tokens\.embedding$", ("vocab", "embed")),                             # [V, D]
    (r"^lm_head\.kernel$", ("embed", "vocab")),                                     # [D, V]
    (r"^layers\.self_attn\.q_proj\.kernel$", ("layers", "embed", "heads")),         # [L, D, Nh*H]
    (r"^layers\.self_attn\.(k_proj|v_proj)\.kernel$", ("layers", "embed", "kv_heads")),  # [L, D, Nkv*H]
    (r"^layers\.self_attn\.o_proj\.kernel$", ("layers", "heads", "embed")),         # [L, Nh*H, D]
    (r"^layers\.self_attn\.(q_norm|k_norm)\.weight$", ("layers", None)),            # [L, H]
    (r"^layers\.mlp\.(gate_proj|up_proj)\.kernel$", ("layers", "embed", "mlp")),    # [L, D, F]
    (r"^layers\.mlp\.down_proj\.kernel$", ("layers", "mlp", "embed")),              # [L, F, D]
    (r"^layers\.(input_layernorm|post_attention_layernorm)\.weight$", ("layers", None)),  # [L, D]
    (r"^norm\.weight$", (None,)),                                                   # [D]
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ``Mesh`` with axes ``("data", "fsdp", "tensor")`` over ``devices`` (default: all devices).

    Args:
      data, fsdp, tensor: axis sizes (positive ints); exactly one may be ``-1`` = the remaining devices.
      devices: the devices to use, default ``jax.devices()``.
    Returns:
      ``jax.sharding.Mesh`` of shape (data, fsdp, tensor) with ``AxisType.Auto`` axes (so
      ``with_sharding_constraint`` and GSPMD propagation apply), laid out by ``jax.make_mesh``.
    Raises:
      ShardingError: more than one ``-1``, a size < 1, or a product that does not divide / equal the
        device count.

    Int axis sizes in, a ``Mesh`` out. Source: the data / fsdp / tensor axes of MaxText and verl's
    FSDP + tensor-parallel layout (``jax.make_mesh``).
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ShardingError(f"make_mesh: at most one axis may be -1, got {sizes}")
    bad = {k: v for k, v in sizes.items() if v != -1 and (not isinstance(v, int) or v < 1)}
    if bad:
        raise ShardingError(f"make_mesh: axis sizes must be positive ints or -1, got {bad}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if n % fixed:
            raise ShardingError(
                f"make_mesh: the fixed axes {sizes} multiply to {fixed}, which does not divide the {n} devices")
        sizes[free[0]] = n // fixed
    elif fixed != n:
        raise ShardingError(f"make_mesh: axis sizes {sizes} multiply to {fixed}, but there are {n} devices")
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _active_axis_names() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    return tuple(mesh.axis_names)


def _fit(entry, dim: int, axis_sizes: Mapping[str, int]):
    """Keep the mesh axes of one spec entry whose product divides ``dim`` (drop from the right)."""
    if entry is None:
        return None
    axes = [entry] if isinstance(entry, str) else list(entry)
    axes = [a for a in axes if a in axis_sizes]
    while axes and dim % math.prod(axis_sizes[a] for a in axes):
        axes.pop()
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _spec(logical: Sequence[Optional[str]], shape: Sequence[int], table: Mapping, axis_sizes: Mapping[str, int],
          units: Optional[Mapping[str, int]] = None) -> P:
    """``units``: logical axis -> block size that must stay whole (head_dim for flattened head axes)."""
    if len(logical) != len(shape):
        raise ShardingError(f"logical axes {tuple(logical)} do not match an array of shape {tuple(shape)}")
    out = []
    for name, dim in zip(logical, shape):
        unit = (units or {}).get(name, 1)
        dim = dim // unit if dim % unit == 0 else dim
        if name is not None and name not in table:
            if name in axis_sizes:      # a raw mesh axis name is accepted as itself
                out.append(_fit(name, dim, axis_sizes))
                continue
            raise ShardingError(f"unknown logical axis {name!r}; known: {sorted(k for k in table if k)}")
        out.append(_fit(table[name], dim, axis_sizes))
    return P(*out)


def logical_to_spec(axes: Sequence[str | None], mesh_axis_names: Sequence[str]) -> P:
    """Map logical activation axis names to a PartitionSpec over the mesh axes that exist (no shape check).

    Args:
      axes: one logical name (or None) per array dimension, e.g. ``("batch", None, "heads")``.
      mesh_axis_names: the axis names of the active mesh.
    Returns:
      A ``PartitionSpec`` with one entry per dimension; mesh axes absent from the mesh are dropped.
    Raises:
      KeyError: an unknown logical axis name.

    Str (or None) axis names in, a ``PartitionSpec`` out. Source: Flax ``logical_to_mesh_axes``
    (MaxText ``logical_axis_rules``).
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

    ``"batch"`` maps to ``("data", "fsdp")``; ``"heads"``, ``"kv_heads"``, ``"mlp"``, ``"vocab"`` and
    ``"tensor"`` map to ``"tensor"``; ``None`` is unsharded. A mesh axis that does not divide the dimension
    is dropped (e.g. batch 1 on ``data=2`` stays replicated) instead of failing.

    Args:
      x: any array with ``len(axes)`` dimensions.
      axes: logical axis per dimension (see ``LOGICAL_AXES``).
    Returns:
      ``x``, constrained to the derived ``PartitionSpec`` when a mesh is active.
    Raises:
      KeyError: an unknown logical axis name (only checked while a mesh is active).

    Dtypes: ``x`` of any dtype, returned unchanged in value and dtype. Source: ``jax.lax.with_sharding_constraint``
    on Flax-style logical axes (MaxText ``nn.with_logical_constraint``).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    sizes = dict(mesh.shape)
    raw = logical_to_spec(axes, tuple(sizes))
    spec = P(*(_fit(e, d, sizes) for e, d in zip(raw, x.shape)))
    return jax.lax.with_sharding_constraint(x, spec)


def param_path(path) -> str:
    """Dotted name of a pytree path into an NNX state (``("layers", "mlp", "up_proj", "kernel")``).

    A pytree key path in, a str out; never raises. Source: the HF-style dotted parameter names
    (``model.layers.mlp.up_proj.kernel``) of ``jax.tree_util`` key paths.
    """
    keys = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if key == "value" and isinstance(k, jax.tree_util.GetAttrKey):
            continue
        keys.append(str(key))
    return ".".join(keys)


def param_logical_axes(name: str, ndim: int, rules=PARAM_RULES) -> tuple[Optional[str], ...]:
    """Logical axes of the parameter called ``name`` (dotted path) under ``rules``.

    Raises:
      ShardingError: no rule matches ``name`` or the matching rule has the wrong rank.

    ``name`` a str, ``ndim`` an int (the parameter's rank, e.g. 3 for a stacked ``[L, D, F]`` kernel);
    returns a tuple of str / None, one per dimension. Source: t5x / MaxText regex partition rules.
    """
    for pattern, logical in (PARAM_RULES if rules is None else rules):
        if re.search(pattern, name):
            if len(logical) != ndim:
                raise ShardingError(f"partition rule {pattern!r} gives {len(logical)} axes for parameter "
                                    f"{name!r} of rank {ndim}")
            return tuple(logical)
    raise ShardingError(f"no partition rule matches parameter {name!r}; add one to models.sharding.PARAM_RULES")


def param_specs(state, axis_sizes: Mapping[str, int], rules=PARAM_RULES):
    """PartitionSpec for every ``nnx.Param`` in ``state`` (other variables: replicated ``P()``).

    Args:
      state: an ``nnx.State`` (concrete arrays or ``jax.ShapeDtypeStruct`` from ``nnx.eval_shape``).
      axis_sizes: mesh axis name -> size (``dict(mesh.shape)``); usable without devices.
      rules: ``(regex, logical axes)`` pairs; ``None`` or default: :data:`PARAM_RULES`.
    Returns:
      The same tree structure with ``PartitionSpec`` values. Flattened head dimensions (``Nh*H``) are
      only split between whole heads (head_dim read from ``q_norm``), e.g. 8 KV heads on ``tensor=16``
      stay replicated rather than splitting heads.
    Raises:
      ShardingError: a parameter without a rule.
    """
    units = {}
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    for path, leaf in flat:
        if re.search(r"(^|\.)q_norm\.weight$", param_path(path)):   # [L, head_dim]: shard whole heads only
            units = {"heads": leaf.shape[-1], "kv_heads": leaf.shape[-1]}

    def one(path, var):
        if not isinstance(var, nnx.Variable):
            return P()
        value = var.get_value()
        if not isinstance(var, nnx.Param) or not hasattr(value, "shape"):
            return var.replace(P())
        logical = param_logical_axes(param_path(path), len(value.shape), rules)
        return var.replace(_spec(logical, value.shape, PARAM_AXES, axis_sizes, units))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def param_shardings(state, mesh: Mesh, rules=PARAM_RULES):
    """``NamedSharding`` for every variable of ``state`` on ``mesh`` (see :func:`param_specs`).

    Args:
      state: ``nnx.State`` or abstract state (``nnx.split(nnx.eval_shape(...))[1]``).
      mesh: a mesh from :func:`make_mesh` (any axis names present in :data:`MESH_AXES` are used).
    Returns:
      The same tree structure with ``jax.sharding.NamedSharding`` values, usable as ``jax.device_put``
      target or ``jax.jit`` in/out shardings.
    Raises:
      ShardingError: a parameter without a rule.

    Dtypes: leaves of any dtype (or ``jax.ShapeDtypeStruct``); only shapes are read. Source: t5x / MaxText rule
    -based parameter partitioning (FSDP over ``fsdp``, Megatron-style tensor parallelism over ``tensor``).
    """
    specs = param_specs(state, dict(mesh.shape), rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def shard_model(model: nnx.Module, mesh: Mesh, rules=PARAM_RULES) -> nnx.Module:
    """Move every variable of ``model`` onto ``mesh`` with :func:`param_shardings`, in place.

    Returns:
      ``model`` (same object), its arrays now ``NamedSharding``-placed.
    Raises:
      ShardingError: a parameter without a rule.

    Dtypes kept (no cast). Source: Flax NNX ``nnx.state`` / ``nnx.update`` with ``jax.device_put`` (t5x / MaxText
    partition rules).
    """
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
    return model


def describe(state, mesh: Mesh, rules=PARAM_RULES) -> dict[str, str]:
    """Parameter name -> ``str(PartitionSpec)``, for logs and ``stapo-jax plan``.

    Shapes: only the parameters' ranks / shapes are read (any dtype); returns a dict of str. Raises
    ShardingError for a parameter without a rule. Source: t5x / MaxText partition-rule logging.
    """
    specs = param_specs(state, dict(mesh.shape), rules)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {param_path(p): str(s) for p, s in leaves}


__all__ = ["MESH_AXES", "LOGICAL_AXES", "PARAM_AXES", "PARAM_RULES", "ShardingError", "make_mesh",
           "logical_to_spec", "constrain", "param_path", "param_logical_axes", "param_specs",
           "param_shardings", "shard_model", "describe"]
