"""``stapo-jax plan``: per-device memory and FLOPs of a run, from its config and a mesh, before paying for it.

Nothing is allocated: the model's parameters come from ``nnx.eval_shape``, the optimizer state from
``jax.eval_shape``, and the two programs a run repeats are lowered and compiled ahead of time
(``jax.jit(...).lower(abstract args with NamedShardings).compile()``) on simulated CPU devices
(``--xla_force_host_platform_device_count=N``, set in a subprocess):

* the **train step**: ``stapo_jax.train.train_step.make_train_step`` on one mini-batch (``ppo_mini_batch_size x
  rollout.n`` sequences of ``max_prompt_length + max_new_tokens`` tokens, ``ppo_micro_batch_size`` sequences
  per device per micro-batch, the recipe's pre-pass, remat policy and optimizer);
* the **rollout decode step**: one token for every slot of ``stapo_jax.rollout.engine.Qwen3Engine``
  (``rollout.max_concurrent_decodes`` slots, each with a KV cache of ``max_prompt_length + max_new_tokens``).

Per device it reports parameters, optimizer state and batch (exact shard sizes of the abstract arrays, and XLA's
``argument_size``), activations/temporaries (XLA's ``temp_size``), the KV cache, XLA's peak estimate
(arguments + outputs - aliased + temporaries) against the device memory, and FLOPs per step from
``compiled.cost_analysis()`` beside an analytic count.

Caveat: the numbers are XLA:CPU's buffer assignment of the SPMD-partitioned per-device program. TPU and GPU
compilers fuse, lay out and schedule differently (and CPU may upcast bf16 dots), so read them as an estimate of
the target's usage, not a guarantee; the analytic columns show what is independent of the compiler.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["PlanError", "DEVICE_MEMORY_GB", "make_spec", "run_plan", "plan", "format_report", "main"]

GiB = 1024 ** 3
GB = 1000 ** 3
# HBM per device, decimal GB as vendors quote it (TPU v5p 95 GB, v6e 32 GB; H100 SXM 80 GB, H200 141 GB).
DEVICE_MEMORY_GB = {"tpu-v5p": 95.0, "tpu-v6e": 32.0, "tpu-v5e": 16.0, "tpu-v4": 32.0, "h100": 80.0, "h200": 141.0,
                    "a100": 80.0}


class PlanError(ValueError):
    """A plan that cannot be built: bad mesh sizes, a model that cannot be resolved, batch shapes that do not
    split over the mesh (the message names the config key)."""


# --------------------------------------------------------------------------------------------- the spec


def plan_model_config(cfg) -> Any:
    """The ``Qwen3Config`` of ``cfg.model``; a hub id in ``model.path`` that is not a local directory is
    resolved by preset name (``Qwen/Qwen3-14B-Base`` -> preset ``Qwen3-14B-Base``) so no download happens.
    No arrays; raises PlanError (unknown hub id), CheckpointError (bad config.json). Source: HF ``config.json``."""
    import dataclasses as dc

    from models.presets import canonical_name, preset
    from stapo_jax.config.build import model_config

    m = cfg.model
    # the plan compiles on CPU: auto resolves to blockwise there; the TPU/GPU kernels (splash, cudnn) are
    # planned with blockwise, which has the same O(T x block) attention memory
    attention = "blockwise" if m.attention in ("splash", "cudnn") else m.attention
    extra = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=attention)
    if m.path:
        p = Path(m.path).expanduser()
        if p.is_dir() or p.is_file():
            from models.hf import read_config

            return read_config(p if p.is_dir() else p.parent, **extra)
        try:
            return preset(canonical_name(str(m.path)), **extra)
        except KeyError as e:
            raise PlanError(f"model.path={m.path!r} is not a local checkpoint and not a known preset name; "
                            f"pass a local directory with config.json") from e
    return dc.replace(model_config(cfg), **extra)


def _mesh_sizes(spec: Optional[str], cfg, devices: Optional[int]) -> tuple[dict[str, int], Optional[str]]:
    """Mesh axis sizes from ``--mesh`` (a configs/mesh YAML, a preset name, or ``data=1,fsdp=8,tensor=1``) or
    ``cfg.mesh``, with ``-1`` resolved against ``devices``; also the device kind the preset names (for HBM)."""
    import yaml

    kind = None
    if spec is None:
        sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    elif "=" in spec:
        sizes = {"data": 1, "fsdp": 1, "tensor": 1}
        for part in spec.split(","):
            k, _, v = part.partition("=")
            if k.strip() not in sizes:
                raise PlanError(f"--mesh: unknown axis {k.strip()!r} (expected data, fsdp, tensor)")
            try:
                sizes[k.strip()] = int(v)
            except ValueError:
                raise PlanError(f"--mesh: axis {k.strip()}={v!r} is not an integer") from None
    else:
        path = Path(spec)
        if not path.is_file():
            path = Path(__file__).resolve().parents[2] / "configs" / "mesh" / f"{spec}.yaml"
        if not path.is_file():
            raise PlanError(f"--mesh {spec!r}: no such file, no configs/mesh/{spec}.yaml, and not data=..,fsdp=..")
        data = yaml.safe_load(path.read_text()) or {}
        mesh = data.get("mesh") if isinstance(data, dict) else None
        if not isinstance(mesh, dict):
            raise PlanError(f"{path}: no 'mesh' section")
        sizes = {"data": 1, "fsdp": 1, "tensor": 1, **{k: int(v) for k, v in mesh.items()}}
        kind = next((k for k in sorted(DEVICE_MEMORY_GB, key=len, reverse=True) if k in path.stem.lower()), None)
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise PlanError(f"mesh {sizes}: at most one axis may be -1")
    if any(v < 1 for v in sizes.values() if v != -1):
        raise PlanError(f"mesh {sizes}: axis sizes must be >= 1 (or one -1)")
    if free:
        if devices is None:
            raise PlanError(f"mesh {sizes} has a -1 axis: pass --devices N (the slice's device count)")
        fixed = math.prod(v for v in sizes.values() if v != -1)
        if devices % fixed:
            raise PlanError(f"mesh {sizes}: {devices} devices are not a multiple of {fixed}")
        sizes[free[0]] = devices // fixed
    if devices is not None and math.prod(sizes.values()) != devices:
        raise PlanError(f"mesh {sizes} has {math.prod(sizes.values())} devices, --devices says {devices}")
    return sizes, kind


def make_spec(cfg, *, mesh: Optional[str] = None, devices: Optional[int] = None,
              hbm_gb: Optional[float] = None, decode: bool = True, train: bool = True,
              opt_state: str = "trainer") -> dict:
    """A JSON-able plan spec from a run config (the input of :func:`run_plan`).

    Args:
      cfg: :class:`stapo_jax.config.schema.Config`.
      mesh: ``--mesh`` value (see :func:`_mesh_sizes`); None = ``cfg.mesh``.
      devices: device count (resolves a ``-1`` axis; checked against the mesh otherwise).
      hbm_gb: device memory in GB (decimal) for the fit verdict; default from the mesh preset's name.
      decode, train: which programs to plan.
      opt_state: ``"trainer"`` (the optimizer-state shardings ``TrainState.create`` produces: moments sharded
        like their parameters) or ``"replicated"`` (what-if); see :func:`abstract_train_state`.
    Returns:
      dict with ``model`` (Qwen3Config fields), ``mesh`` sizes, ``devices``, ``hbm_gb``, batch shapes, ``recipe``,
      optimizer and engine settings.
    Raises:
      PlanError: see :func:`_mesh_sizes`; the mini-batch does not split over the data shards and micro-batches.
    No arrays: int / float / bool / str fields. Source: verl's ``ppo_mini_batch_size`` / ``ppo_micro_batch_size``."""
    from stapo_jax.config.schema import ConfigError

    sizes, kind = _mesh_sizes(mesh, cfg, devices)
    n = math.prod(sizes.values())
    dp = sizes["data"] * sizes["fsdp"]
    try:
        accum = cfg.grad_accum_steps(dp)
    except ConfigError as e:
        raise PlanError(str(e)) from e
    qcfg = plan_model_config(cfg)
    a = cfg.actor
    return {
        "model": dataclasses.asdict(qcfg),
        "mesh": sizes, "devices": n,
        "hbm_gb": hbm_gb if hbm_gb is not None else DEVICE_MEMORY_GB.get(kind) if kind else None,
        "device_kind": kind,
        "recipe": cfg.algorithm.recipe,
        "s2t_scope": cfg.s2t.quantile_scope, "top_entropy_scope": cfg.top_entropy.scope,
        "mini_batch_sequences": a.ppo_mini_batch_size * cfg.rollout.n,
        "micro_batch_per_device": a.ppo_micro_batch_size, "num_micro_batches": accum,
        "updates_per_step": cfg.trainer.train_batch_size // a.ppo_mini_batch_size * a.ppo_epochs,
        "prompt_length": cfg.data.max_prompt_length, "response_length": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature, "seq_chunk": a.logprob_seq_chunk or 0,
        "vocab_chunk": a.logprob_vocab_chunk, "use_remove_padding": cfg.model.use_remove_padding,
        "optim": dataclasses.asdict(a.optim),
        "use_kl": bool(a.use_kl_loss and a.kl_loss_coef > 0), "sampler_is": a.sampler_is != "off",
        "s2t_minibatch_method": cfg.s2t.minibatch_method,
        # the trainer hands the update the old-log-prob pass's entropies (stats_policy=old, correction mode)
        "old_stats": cfg.s2t.enabled and (cfg.s2t.stats_policy == "old" or cfg.s2t.minibatch_method == "correction"),
        "decode_slots": cfg.rollout.max_concurrent_decodes,
        "rollout_sequences_per_step": cfg.trainer.train_batch_size * cfg.rollout.n,
        "plan_train": train, "plan_decode": decode, "opt_state": opt_state,
    }


# ------------------------------------------------------------------------------------------ the worker


def _itemsize(dtype) -> int:
    import numpy as np

    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # a typed PRNG key: 2 x uint32 (threefry)
        return 8


def _shard_bytes(tree) -> int:
    """Bytes one device holds of the abstract arrays in ``tree`` (each leaf carries a ``NamedSharding``)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * _itemsize(leaf.dtype)
    return total


def _total_bytes(tree) -> int:
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


def abstract_train_state(qcfg, optimizer, mesh, opt_state: str = "trainer"):
    """``(abstract TrainState, its shardings)``; nothing is allocated.

    Parameters follow ``models.sharding.param_shardings``. The optimizer state's shardings:

    * ``"trainer"``: what ``stapo_jax.train.train_step.TrainState.create`` places (``optimizer_state_shardings``:
      AdamW moments sharded like their parameters, scalars replicated);
    * ``"replicated"``: the what-if of a plain ``jit(optimizer.init)``, whose moments XLA replicates.
    Leaves ``jax.ShapeDtypeStruct`` (param_dtype, int32 step); PlanError for another opt_state. Source: optax."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.qwen3 import Qwen3
    from models.sharding import param_shardings
    from stapo_jax.train.train_step import TrainState, optimizer_state_shardings

    if opt_state not in ("trainer", "replicated"):
        raise PlanError(f"opt_state={opt_state!r}: expected 'trainer' or 'replicated'")
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0))))
    p_sh = param_shardings(params, mesh)
    params = _abstract(params, p_sh)
    rep = NamedSharding(mesh, P())
    opt_abs = jax.eval_shape(optimizer.init, params)
    if opt_state == "trainer":  # what TrainState.create places: moments sharded like their parameters
        opt_sh = optimizer_state_shardings(optimizer, params, p_sh, mesh)
    else:  # what-if: XLA's choice for a plain jit(optimizer.init) (replicated moments)
        opt_sh = jax.jit(optimizer.init).lower(params).compile().output_shardings
    opt_state_abs = _abstract(opt_abs, opt_sh)
    state = TrainState(params=params, opt_state=opt_state_abs,
                       step=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), graphdef=graphdef)
    shardings = TrainState(params=p_sh, opt_state=opt_sh, step=rep, graphdef=graphdef)
    return state, shardings


def _plan_train(spec, qcfg, mesh) -> dict:
    import jax
    import jax.numpy as jnp

    from stapo_jax.train.optim import make_optimizer
    from stapo_jax.algo.s2t import minibatch_stats_mode
    from stapo_jax.train.packing import PackedLayout
    from stapo_jax.train.train_step import Batch, batch_sharding, make_train_step

    o = spec["optim"]
    opt = make_optimizer(o["lr"], o["warmup_steps"], o["weight_decay"], o["clip_grad"], o["betas"], o["eps"])
    recipe = _spec_recipe(spec)
    with jax.set_mesh(mesh):
        state, shardings = abstract_train_state(qcfg, opt, mesh, spec.get("opt_state", "trainer"))
        b, p, r = spec["mini_batch_sequences"], spec["prompt_length"], spec["response_length"]
        bs = batch_sharding(mesh)
        sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=bs)  # noqa: E731
        f32 = lambda: sd((b, r), jnp.float32)  # noqa: E731
        batch = Batch(input_ids=sd((b, p + r), jnp.int32), attention_mask=sd((b, p + r), jnp.bool_),
                      response_mask=sd((b, r), jnp.int32), advantages=sd((b,), jnp.float32), old_log_probs=f32(),
                      ref_log_probs=f32() if spec["use_kl"] else None,
                      rollout_log_probs=f32() if spec["sampler_is"] else None,
                      old_entropy=f32() if spec["old_stats"] else None)
        if spec.get("use_remove_padding"):  # packed rows of P + R tokens, the worst case: one sequence per row
            i32 = lambda shape: sd(shape, jnp.int32)  # noqa: E731
            dp = mesh.shape["data"] * mesh.shape["fsdp"]
            batch = batch.replace(packing=PackedLayout(i32((b, p + r)), i32((b, p + r)), i32((b, p + r)),
                                                       i32((b, r)), num_shards=dp))
        step = make_train_step(recipe, opt, num_micro_batches=spec["num_micro_batches"],
                               temperature=spec["temperature"], seq_chunk=spec["seq_chunk"] or 512,
                               vocab_chunk=spec["vocab_chunk"], vocab_size=qcfg.vocab_size, mesh=mesh,
                               state_shardings=shardings, donate=True)
        compiled = step.lower(state, batch).compile()
    return {
        "params_bytes": _shard_bytes(state.params), "opt_state_bytes": _shard_bytes(state.opt_state),
        "batch_bytes": _shard_bytes(batch), "params_total_bytes": _total_bytes(state.params),
        "memory": _memory(compiled), "flops_per_device": _flops(compiled),
        "prepass": minibatch_stats_mode(recipe, spec["old_stats"]) == "prepass",
    }


def _spec_recipe(spec: dict):
    """The :class:`~stapo_jax.algo.recipes.Recipe` a plan spec describes (name plus the scopes / S2T method)."""
    from stapo_jax.algo.masks import QUANTILE_SCOPES
    from stapo_jax.algo.recipes import get_recipe

    changes = {}
    if spec["s2t_scope"] in QUANTILE_SCOPES:
        changes["s2t"] = {"quantile_scope": spec["s2t_scope"],
                          "minibatch_method": spec.get("s2t_minibatch_method", "correction")}
    if spec["top_entropy_scope"] in QUANTILE_SCOPES:
        changes["top_entropy"] = {"scope": spec["top_entropy_scope"]}
    return get_recipe(spec["recipe"], **changes)


def abstract_engine_spec(qcfg, engine_config, mesh, graphdef):
    """The static ``DecodeSpec`` of ``stapo_jax.rollout.decode_fns``' jitted prefill/insert/step functions for a
    model and engine config, built without placing weights (``Qwen3Engine.__init__`` ``device_put``s the model),
    so the very functions the engine runs can be lowered with abstract arguments.
    No arrays; never raises. Source: JetStream's engine functions, lowered AOT (``jax.ShapeDtypeStruct`` args)."""
    from stapo_jax.rollout.decode_fns import abstract_decode_spec
    from stapo_jax.rollout.engine import engine_stop_ids

    return abstract_decode_spec(graphdef, qcfg, engine_config, mesh, engine_stop_ids(qcfg, engine_config))


def _plan_decode(spec, qcfg, mesh) -> dict:
    import jax
    from flax import nnx

    from models.qwen3 import Qwen3
    from models.sharding import param_shardings
    from stapo_jax.rollout import engine as eng
    from stapo_jax.rollout.decode_fns import init_fn, step_fn
    from stapo_jax.rollout.sampling import SamplingParams

    graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0))))
    params = _abstract(params, param_shardings(params, mesh))
    ecfg = eng.EngineConfig(max_concurrent_decodes=spec["decode_slots"], max_prefill_length=spec["prompt_length"],
                            max_decode_length=spec["response_length"])
    espec = abstract_engine_spec(qcfg, ecfg, mesh, graphdef)
    with jax.set_mesh(mesh):
        state = _abstract(jax.eval_shape(init_fn, espec, jax.random.key(0)), espec.state_shardings)
        compiled = step_fn.lower(espec, params, state, SamplingParams(temperature=spec["temperature"])).compile()
    return {"params_bytes": _shard_bytes(params), "kv_cache_bytes": _shard_bytes((state.cache.k, state.cache.v)),
            "decode_state_bytes": _shard_bytes(state), "memory": _memory(compiled),
            "flops_per_device": _flops(compiled)}


def run_plan(spec: dict) -> dict:
    """Build and compile the planned programs in this process (which must see ``spec["devices"]`` devices).

    Returns:
      ``{"spec": spec, "train": {...}, "decode": {...}, "analytic": {...}}``; byte counts are per device.
    Raises:
      PlanError: this process sees a different number of devices.
    No arrays: int / float / str dicts. Source: XLA ``compiled.memory_analysis()`` / ``cost_analysis()``."""
    import jax

    from models.qwen3 import Qwen3Config
    from models.sharding import make_mesh

    if len(jax.devices()) != spec["devices"]:
        raise PlanError(f"run_plan: this process has {len(jax.devices())} devices, the plan needs "
                        f"{spec['devices']} (use plan(), which simulates them in a subprocess)")
    qcfg = Qwen3Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["model"].items()})
    mesh = make_mesh(**spec["mesh"])
    out = {"spec": spec, "analytic": analytic(spec, qcfg)}
    if spec.get("plan_train", True):
        out["train"] = _plan_train(spec, qcfg, mesh)
    if spec.get("plan_decode", True):
        out["decode"] = _plan_decode(spec, qcfg, mesh)
    return out


# ---------------------------------------------------------------------------------------- analytic


def analytic(spec: dict, qcfg) -> dict:
    """Compiler-independent counts: parameters, ideal per-device bytes (everything divided evenly over the
    shards that hold it) and matmul FLOPs of one update and of one decode step.

    FLOPs (dense, padding included, attention over the full T x T score matrix as the XLA kernel computes it):
    forward per sequence = 2 x (matmul params x T) + 4 x L x T^2 x Nh x H + 2 x D x V x R (LM head on the
    response positions only); an update = forward x (1 pre-pass if any + 1) + 2 x forward (backward) + the
    remat recompute (``full``: the decoder forward again; ``dots_no_batch``: the attention score/value
    matmuls, which have batch dimensions; ``dots``/``none``: none). S2T's ``correction`` method: ``train_flops_per_update`` counts no corrections (its usual
    case), ``train_flops_per_update_max`` every micro-batch redone (+ 1 + remat + 2 forwards).
    No arrays: int / float counts; raises KeyError for a spec not from :func:`make_spec`. Source: Kaplan et al. 2020
    (forward = 2 x params x tokens, backward = 2 x forward)."""
    d, f, layers = qcfg.hidden_size, qcfg.intermediate_size, qcfg.num_hidden_layers
    nh, nkv, h, v = qcfg.num_attention_heads, qcfg.num_key_value_heads, qcfg.head_dim, qcfg.vocab_size
    layer = d * nh * h * 2 + d * nkv * h * 2 + 3 * d * f
    n_params = layers * (layer + 2 * d + 2 * h) + v * d + d + (0 if qcfg.tie_word_embeddings else d * v)
    mesh = spec["mesh"]
    shards = mesh["fsdp"] * mesh["tensor"]
    itemsize = 2 if qcfg.param_dtype in ("bfloat16", "float16") else 4
    p, r = spec["prompt_length"], spec["response_length"]
    t = p + r
    fwd = 2 * layers * layer * t + 4 * layers * t * t * nh * h + 2 * d * v * r
    from stapo_jax.algo.s2t import minibatch_stats_mode

    mode = minibatch_stats_mode(_spec_recipe(spec), spec["old_stats"])
    recompute = {"full": 2 * layers * layer * t + 4 * layers * t * t * nh * h,
                 "dots_no_batch": 4 * layers * t * t * nh * h}.get(qcfg.remat, 0)  # remat, per sequence
    grad_passes = 1 + recompute / fwd + 2  # forward (+ recompute) + backward, in forwards
    passes = (1 if mode == "prepass" else 0) + grad_passes
    # S2T correction: XLA counts the compiled conditional, in which every micro-batch is redone (the worst case)
    correction = mode == "correction"
    b = spec["mini_batch_sequences"]
    cache_item = 2 if qcfg.dtype in ("bfloat16", "float16") else 4
    slot_shards = min(spec["decode_slots"], mesh["data"] * mesh["fsdp"])
    kv_shards = slot_shards * (mesh["tensor"] if nkv % mesh["tensor"] == 0 else 1)
    kv = 2 * layers * spec["decode_slots"] * t * nkv * h * cache_item
    decode_fwd = 2 * (layers * layer + d * v) + 4 * layers * t * nh * h
    return {
        "params": n_params, "params_bytes_ideal": n_params * itemsize / shards,
        "opt_state_bytes_ideal": 2 * n_params * itemsize / shards,
        "kv_cache_bytes_ideal": kv / kv_shards, "kv_cache_total_bytes": kv,
        "train_flops_per_update": float(b * fwd * passes),
        "train_flops_per_update_max": float(b * fwd * (passes + (grad_passes if correction else 0))),
        "forward_flops_per_sequence": float(fwd),
        "decode_flops_per_step": float(spec["decode_slots"] * decode_fwd),
        # one layer's attention scores of one sequence in float32, [heads / tensor shards, T, T]
        "attention_scores_bytes": (nh / (mesh["tensor"] if nh % mesh["tensor"] == 0 else 1)) * t * t * 4,
    }


# ------------------------------------------------------------------------------------ subprocess + CLI


def plan(spec: dict, *, timeout_s: Optional[float] = None) -> dict:
    """:func:`run_plan` with ``spec["devices"]`` simulated CPU devices, in a fresh subprocess.

    Raises:
      RuntimeError: the subprocess failed (its output tail is in the message).
    No arrays (int / float / str dicts); ``timeout_s`` seconds, past it ``subprocess.TimeoutExpired``. Source: JAX
    ``--xla_force_host_platform_device_count``."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                   + f" --xla_force_host_platform_device_count={spec['devices']}")
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run([sys.executable, "-m", "stapo_jax.tools.plan", "--worker", str(spec_path), str(out_path)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not out_path.is_file():
            raise RuntimeError(f"plan subprocess failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
        return json.loads(out_path.read_text())


def _gb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def format_report(result: dict) -> str:
    """Human-readable report of :func:`run_plan`'s result (per-device memory in GB = 1e9 bytes; FLOPs).
    No arrays: str out. Raises KeyError for a result not from :func:`run_plan`. Source: XLA ``memory_analysis``."""
    s, a = result["spec"], result["analytic"]
    m = s["model"]
    hbm = s.get("hbm_gb")
    lines = [
        f"model: L={m['num_hidden_layers']} D={m['hidden_size']} F={m['intermediate_size']} "
        f"heads={m['num_attention_heads']}/{m['num_key_value_heads']} V={m['vocab_size']} "
        f"tied={m['tie_word_embeddings']}  params={a['params'] / 1e9:.4g}B  dtype={m['dtype']} "
        f"param_dtype={m['param_dtype']} remat={m['remat']} attention={m.get('attention', 'xla')}",
        f"mesh: {s['mesh']} = {s['devices']} devices"
        + (f" ({s['device_kind'] or 'device'}: {hbm:g} GB each)" if hbm else " (device memory unknown: pass --hbm-gb)"),
        f"recipe: {s['recipe']}  mini-batch {s['mini_batch_sequences']} sequences x {s['prompt_length']}+"
        f"{s['response_length']} tokens, {s['micro_batch_per_device']} per device per micro-batch, "
        f"{s['num_micro_batches']} micro-batches, {s['updates_per_step']} updates per step; "
        f"optimizer state: {s.get('opt_state', 'trainer')}; model.use_remove_padding: "
        + ("packed rows of P+R tokens, planned at the worst case (every sequence full length)"
           if s.get("use_remove_padding") else "off (padded rows)"),
        "", "per device, GB (1e9 bytes)          XLA (CPU-compiled)   analytic (even split)"]
    verdicts = []
    if "train" in result:
        t, mem = result["train"], result["train"]["memory"]
        lines += [
            "train step (one mini-batch update)",
            f"  parameters                        {_gb(t['params_bytes']):>10}   {_gb(a['params_bytes_ideal']):>10}",
            f"  optimizer state                   {_gb(t['opt_state_bytes']):>10}   {_gb(a['opt_state_bytes_ideal']):>10}",
            f"  batch                             {_gb(t['batch_bytes']):>10}",
            f"  arguments (XLA)                   {_gb(mem['argument']):>10}",
            f"  activations / temporaries (XLA)   {_gb(mem['temp']):>10}",
            f"    (one layer's f32 attention scores of one sequence: {_gb(a['attention_scores_bytes'])} GB"
            + (", not materialised by this attention)" if m.get("attention", "xla") != "xla" else ")"),
            f"  peak = args + outputs - aliased + temp {_gb(mem['peak']):>7}",
            f"  FLOPs per update: XLA {t['flops_per_device'] or 0:.3e} per device x {s['devices']} = "
            f"{(t['flops_per_device'] or 0) * s['devices']:.3e};  analytic {a['train_flops_per_update']:.3e}"
            + (f" (every S2T correction run: {a['train_flops_per_update_max']:.3e})"
               if a["train_flops_per_update_max"] != a["train_flops_per_update"] else "")
            + f"  (x{s['updates_per_step']} updates per step)"]
        verdicts.append(("train step", mem["peak"]))
    if "decode" in result:
        dd, mem = result["decode"], result["decode"]["memory"]
        lines += [
            f"rollout decode step ({s['decode_slots']} slots x {s['prompt_length'] + s['response_length']} tokens)",
            f"  parameters (the engine's per-layer copy) {_gb(dd['params_bytes']):>4}",
            f"  KV cache                          {_gb(dd['kv_cache_bytes']):>10}   {_gb(a['kv_cache_bytes_ideal']):>10}",
            f"  temporaries (XLA)                 {_gb(mem['temp']):>10}",
            f"  peak of the decode step           {_gb(mem['peak']):>10}",
            f"  FLOPs per decode step: XLA {dd['flops_per_device'] or 0:.3e} per device;  analytic "
            f"{a['decode_flops_per_step']:.3e} total"]
        # the trainer's parameters and AdamW moments stay resident beside the engine's own parameter copy
        resident = (result["train"]["opt_state_bytes"] + result["train"]["params_bytes"]) if "train" in result else 0
        rollout_peak = mem["peak"] + resident
        lines.append(f"rollout phase (decode peak + resident trainer parameters and optimizer state) "
                     f"{_gb(rollout_peak):>8}")
        verdicts.append(("rollout phase", rollout_peak))
    if hbm:
        lines.append("")
        for name, peak in verdicts:
            ok = peak <= hbm * GB
            lines.append(f"{name}: {_gb(peak)} GB of {hbm:g} GB per device -> {'FITS' if ok else 'DOES NOT FIT'}"
                         f" ({100 * peak / (hbm * GB):.0f}%)")
    return "\n".join(lines)


def fits(result: dict) -> Optional[bool]:
    """True/False when the device memory is known: every planned phase's peak fits; None otherwise.
    No arrays: bool / None (bytes as int / float); KeyError for a foreign result. Source: XLA memory_analysis."""
    hbm = result["spec"].get("hbm_gb")
    if not hbm:
        return None
    peaks = []
    if "train" in result:
        peaks.append(result["train"]["memory"]["peak"])
    if "decode" in result:
        peaks.append(result["decode"]["memory"]["peak"] + result.get("train", {}).get("opt_state_bytes", 0))
    return all(p <= hbm * GB for p in peaks)


def build_parser() -> argparse.ArgumentParser:
    """The command's ``argparse`` parser (see the module docstring for the options).
    No arrays: str / int / float options; never raises (bad arguments exit 2). Source: verl-style dotted overrides."""
    p = argparse.ArgumentParser(prog="stapo-jax plan", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="dotted config overrides key.sub=value")
    p.add_argument("--config", help="run config YAML (e.g. configs/paper/qwen3-14b-base-stapo.yaml)")
    p.add_argument("--model", help="HF checkpoint dir, config.json, or preset name (sets model.path / preset)")
    p.add_argument("--mesh", help="configs/mesh YAML, preset name (tpu-v5p-64), or data=1,fsdp=8,tensor=1 "
                                  "(default: the config's mesh)")
    p.add_argument("--devices", type=int, help="device count (needed when the mesh has a -1 axis)")
    p.add_argument("--hbm-gb", type=float, help="memory per device in GB (default: from the mesh preset name)")
    p.add_argument("--only", choices=("train", "decode"), help="plan only one of the two programs")
    p.add_argument("--opt-state", choices=("trainer", "replicated"), default="trainer",
                   help="optimizer-state shardings: as TrainState.create makes them (default: AdamW moments "
                        "sharded like their parameters), or replicated (what-if of a plain jit(optimizer.init))")
    p.add_argument("--json", help="also write the full result as JSON here")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax plan``; exit code 0 (fits or unknown memory), 1 (does not fit), 2 (bad input).
    No arrays: argv str, int exit code; ConfigError / PlanError / FileNotFoundError / KeyError exit 2, not raised."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        spec = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(run_plan(spec)))
        return 0
    from stapo_jax.config.schema import ConfigError, load_config

    overrides = list(args.overrides)
    if args.model:
        is_path = Path(args.model).exists()
        overrides += ([f"model.path={args.model}", "model.preset=null"] if is_path
                      else [f"model.preset={args.model}", "model.path=null"])
    try:
        cfg = load_config(args.config, overrides)
        spec = make_spec(cfg, mesh=args.mesh, devices=args.devices, hbm_gb=args.hbm_gb,
                         train=args.only != "decode", decode=args.only != "train", opt_state=args.opt_state)
    except (ConfigError, PlanError, FileNotFoundError, KeyError) as e:
        print(f"stapo-jax plan: {e}", file=sys.stderr)
        return 2
    result = plan(spec)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = fits(result)
    return 1 if ok is False else 0


if __name__ == "__main__":
    sys.exit(main())
