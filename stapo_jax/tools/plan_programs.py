"""The two programs ``stapo-jax plan`` compiles ahead of time, from abstract arguments (nothing allocated): the
train step on one mini-batch in the layout the trainer gives it, and the rollout engine's decode step.

Byte counts are per device (the shard shapes of ``jax.ShapeDtypeStruct`` leaves carrying a ``NamedSharding``);
memory and FLOPs are XLA's ``compiled.memory_analysis()`` / ``cost_analysis()``.
"""
from __future__ import annotations

from typing import Optional

from stapo_jax.tools.plan_analytic import packed_slot_bound, spec_optimizer, spec_policy_update, spec_recipe

__all__ = ["PlanError", "shard_bytes", "total_bytes", "abstract_params", "abstract_train_state", "abstract_engine_spec",
           "train_batch_layout", "plan_train", "plan_decode"]


class PlanError(ValueError):
    """A plan that cannot be built: bad mesh sizes, a model that cannot be resolved, batch shapes that do not
    split over the mesh (the message names the config key)."""


def _itemsize(dtype) -> int:
    import numpy as np

    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # a typed PRNG key: 2 x uint32 (threefry)
        return 8


def shard_bytes(tree) -> int:
    """Bytes one device holds of the arrays in ``tree`` (abstract or concrete, any dtype; each leaf carries a
    ``NamedSharding``: its ``shard_shape``). Returns an int; raises AttributeError for a leaf without a sharding.
    Source: ``jax.sharding.NamedSharding.shard_shape``."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * _itemsize(leaf.dtype)
    return total


def total_bytes(tree) -> int:
    """Bytes of the whole (unsharded) arrays in ``tree`` (any shapes / dtypes; a typed PRNG key counts 8).
    Returns an int; never raises for array leaves. Source: numpy ``dtype.itemsize``."""
    import jax
    import numpy as np

    return sum(int(np.prod(x.shape, dtype=np.int64)) * _itemsize(x.dtype) for x in jax.tree.leaves(tree))


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp",
                                                              "generated_code")}
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def _flops(compiled) -> Optional[float]:
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    v = (ca or {}).get("flops")
    return float(v) if v is not None else None


def abstract_params(qcfg, mesh):
    """``(graphdef, abstract parameters)`` of a ``Qwen3`` with ``qcfg``: ``jax.ShapeDtypeStruct`` leaves (param_dtype)
    carrying ``models.sharding.param_shardings`` on ``mesh``; nothing allocated or executed. Raises what
    ``param_shardings`` raises for a mesh without the model's axes. Source: ``nnx.eval_shape``."""
    from flax import nnx

    from models.qwen3 import Qwen3
    from models.sharding import param_shardings

    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0))))
    return graphdef, _abstract(params, param_shardings(params, mesh))


def abstract_train_state(qcfg, optimizer, mesh, opt_state: str = "trainer"):
    """``(abstract TrainState, its shardings)``; nothing is allocated.

    Parameters follow ``models.sharding.param_shardings``. The optimizer state's shardings:

    * ``"trainer"``: what ``stapo_jax.train.train_step.TrainState.create`` places (``optimizer_state_shardings``:
      AdamW moments sharded like their parameters, scalars replicated);
    * ``"replicated"``: the what-if of a plain ``jit(optimizer.init)``, whose moments XLA replicates.
    Call it outside ``jax.set_mesh`` of a target mesh: optax's ``tree_map_params`` runs ``optimizer.init`` eagerly
    (on the host's default device, not the target's).
    Leaves ``jax.ShapeDtypeStruct`` (param_dtype, int32 step); PlanError for another opt_state. Source: optax."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from stapo_jax.train.train_step import TrainState, optimizer_state_shardings

    if opt_state not in ("trainer", "replicated"):
        raise PlanError(f"opt_state={opt_state!r}: expected 'trainer' or 'replicated'")
    graphdef, params = abstract_params(qcfg, mesh)
    p_sh = jax.tree.map(lambda x: x.sharding, params)
    rep = NamedSharding(mesh, P())
    opt_abs = jax.eval_shape(optimizer.init, params)
    if opt_state == "trainer":  # what TrainState.create places: moments sharded like their parameters
        opt_sh = optimizer_state_shardings(optimizer, params, p_sh, mesh)
    else:  # what-if: XLA's choice for a plain jit(optimizer.init) (replicated moments)
        with jax.set_mesh(mesh):  # compiled (not run) on the mesh: XLA's placement there
            opt_sh = jax.jit(optimizer.init).lower(params).compile().output_shardings
    opt_state_abs = _abstract(opt_abs, opt_sh)
    state = TrainState(params=params, opt_state=opt_state_abs,
                       step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), graphdef=graphdef)
    shardings = TrainState(params=p_sh, opt_state=opt_sh, step=rep, graphdef=graphdef)
    return state, shardings


def train_batch_layout(spec: dict, num_shards: int) -> dict:
    """The mini-batch layout the trainer hands the train step for a plan spec (ints / str):

    * ``"padded"`` (``model.use_remove_padding=false``): ``rows`` = the mini-batch's sequences, K micro-batches;
    * ``"packed rows"`` (packed, an update that depends on a row's micro-batch, so ``trainer.py`` keeps the
      configured K and one sequence per row at worst): ``rows`` = sequences, packed rows ``[rows, P + R]``;
    * ``"slots"`` (packed, ``micro_batches.balance_allowed``: micro-batches chosen by tokens, ``packing.token_budget_slots``):
      the largest slot layout (:func:`~stapo_jax.tools.plan_analytic.packed_slot_bound`): ``rows`` = ``S x K' x
      n_max`` slots, K' micro-batches, each with packed rows ``M x L`` = the padded micro-batch's ``per / K`` rows
      of ``P + R`` (the token budget: every ``micro_batch_rows`` geometry the trainer accepts holds at most as many
      tokens; with rows of at most ``P + R``, as splash / cudnn / xla use, it is one of them).
    Returns ``{"kind", "rows", "micro_batches", "packed_rows" (global M count, 0 padded), "row_length", "n_max"}``
    plus the bound's fields for ``"slots"``. Raises KeyError for a spec not from ``make_spec``, ValueError for sizes
    that do not split (as ``packed_slot_bound``). Source: ``stapo_jax.train.trainer`` / ``policy_update.update_policy``."""
    from stapo_jax.train.micro_batches import balance_allowed

    b, k = spec["mini_batch_sequences"], spec["num_micro_batches"]
    width = spec["prompt_length"] + spec["response_length"]
    if not spec.get("use_remove_padding"):
        return {"kind": "padded", "rows": b, "micro_batches": k, "packed_rows": 0, "row_length": width,
                "n_max": b // num_shards // k}
    if not balance_allowed(spec_recipe(spec)):
        return {"kind": "packed rows", "rows": b, "micro_batches": k, "packed_rows": b, "row_length": width,
                "n_max": b // num_shards // k}
    bound = packed_slot_bound(b, k, num_shards, width, spec["max_sequences"])
    kk, m_b = bound["micro_batches"], bound["sequences_per_padded_micro_batch"]
    return {"kind": "slots", "rows": bound["slots"], "packed_rows": kk * num_shards * m_b, "row_length": width,
            **bound}


def plan_train(spec: dict, qcfg, mesh) -> dict:
    """Compile the train step (the run's ``PolicyUpdate.programs(K)`` step, donated state) on one abstract mini-batch in the layout of
    :func:`train_batch_layout`. ``spec`` from ``make_spec``; qcfg a ``Qwen3Config``; mesh a ``jax.sharding.Mesh``.

    Batch leaves: input_ids int32 / attention_mask bool ``[rows, P + R]``; response_mask int32, old_log_probs /
    ref / rollout log-probs / old_entropy float32 ``[rows, R]``; advantages float32 ``[rows]``; packed: a
    ``PackedLayout`` of int32 ``[packed_rows, L]`` x 3 and response_index int32 ``[rows, R]``.
    Returns per-device bytes (``params_bytes``, ``opt_state_bytes``, ``batch_bytes``), ``memory`` (XLA's
    argument / output / alias / temp / peak bytes), ``flops_per_device``, ``prepass``, ``layout``. Raises
    PlanError / ValueError as :func:`abstract_train_state` / :func:`train_batch_layout`, and what XLA raises for a
    program it cannot compile. Source: ``stapo_jax.train.train_step`` (the trainer's own step)."""
    import jax
    import jax.numpy as jnp

    from stapo_jax.algo.s2t import minibatch_stats_mode
    from stapo_jax.train.packing import PackedLayout
    from stapo_jax.train.train_step import Batch, batch_sharding

    opt = spec_optimizer(spec)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    layout = train_batch_layout(spec, dp)
    state, shardings = abstract_train_state(qcfg, opt, mesh, spec.get("opt_state", "trainer"))  # outside the mesh
    with jax.set_mesh(mesh):
        b, p, r = layout["rows"], spec["prompt_length"], spec["response_length"]
        bs = batch_sharding(mesh)
        sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=bs)  # noqa: E731
        f32 = lambda: sd((b, r), jnp.float32)  # noqa: E731
        batch = Batch(input_ids=sd((b, p + r), jnp.int32), attention_mask=sd((b, p + r), jnp.bool_),
                      response_mask=sd((b, r), jnp.int32), advantages=sd((b,), jnp.float32), old_log_probs=f32(),
                      ref_log_probs=f32() if spec["use_kl"] else None,
                      rollout_log_probs=f32() if spec["sampler_is"] else None,
                      old_entropy=f32() if spec["old_stats"] else None)
        if layout["packed_rows"]:
            i32 = lambda shape: sd(shape, jnp.int32)  # noqa: E731
            rows = (layout["packed_rows"], layout["row_length"])
            batch = batch.replace(packing=PackedLayout(i32(rows), i32(rows), i32(rows), i32((b, r)), num_shards=dp))
        step = spec_policy_update(spec, qcfg, mesh, shardings).programs(layout["micro_batches"])[1]
        compiled = step.lower(state, batch).compile()
    return {
        "params_bytes": shard_bytes(state.params), "opt_state_bytes": shard_bytes(state.opt_state),
        "batch_bytes": shard_bytes(batch), "params_total_bytes": total_bytes(state.params),
        "memory": _memory(compiled), "flops_per_device": _flops(compiled),
        "prepass": minibatch_stats_mode(spec_recipe(spec), spec["old_stats"]) == "prepass", "layout": layout,
    }


def abstract_engine_spec(qcfg, engine_config, mesh, graphdef):
    """The static ``DecodeSpec`` of ``stapo_jax.rollout.decode_fns``' jitted prefill/insert/step functions for a
    model and engine config, built without placing weights (``Qwen3Engine.__init__`` ``device_put``s the model),
    so the very functions the engine runs can be lowered with abstract arguments.
    Raises nothing of its own (errors come from ``abstract_decode_spec``). Source: JetStream's engine
    functions, lowered AOT (``jax.ShapeDtypeStruct`` args)."""
    from stapo_jax.rollout.decode_fns import abstract_decode_spec
    from stapo_jax.rollout.engine import engine_stop_ids

    return abstract_decode_spec(graphdef, qcfg, engine_config, mesh, engine_stop_ids(qcfg, engine_config))


def plan_decode(spec: dict, qcfg, mesh) -> dict:
    """Compile the rollout engine's decode step (``decode_fns.step_fn``: one token for each of
    ``rollout.max_concurrent_decodes`` slots, KV cache ``[L, slots, P + R, Nkv, H]`` in the model dtype) from
    abstract parameters and decode state. Returns per-device ``params_bytes`` (the engine's per-layer copy, in
    :func:`models.decode.decode_layer_dtype`), ``kv_cache_bytes``,
    ``decode_state_bytes``, ``memory`` (XLA bytes) and ``flops_per_device``. Raises what XLA raises for a program it
    cannot compile, KeyError for a spec not from ``make_spec``. Source: JetStream's generate step."""
    import jax

    from stapo_jax.rollout import engine as eng
    from models.decode import decode_layer_dtype
    from stapo_jax.rollout.decode_fns import as_decode_params, init_fn, step_fn
    from stapo_jax.rollout.sampling import SamplingParams

    graphdef, params = abstract_params(qcfg, mesh)
    key = jax.eval_shape(lambda: jax.random.key(0))  # made outside the mesh: nothing runs on a target's devices
    # the layout an accelerator run holds (models.linear.preferred_kernel_layout off CPU), not this host's choice
    ecfg = eng.EngineConfig(max_concurrent_decodes=spec["decode_slots"], max_prefill_length=spec["prompt_length"],
                            max_decode_length=spec["response_length"], kernel_layout="in_out")
    espec = abstract_engine_spec(qcfg, ecfg, mesh, graphdef)
    with jax.set_mesh(mesh):
        state = _abstract(jax.eval_shape(init_fn, espec, key), espec.state_shardings)
        compiled = step_fn.lower(espec, params, state, SamplingParams(temperature=spec["temperature"])).compile()
    engine_params = as_decode_params(params, ecfg.kernel_layout, decode_layer_dtype(qcfg))  # what the engine holds
    return {"params_bytes": shard_bytes(engine_params), "kv_cache_bytes": shard_bytes((state.cache.k, state.cache.v)),
            "decode_state_bytes": shard_bytes(state), "memory": _memory(compiled),
            "flops_per_device": _flops(compiled)}
