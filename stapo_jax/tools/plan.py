"""``stapo-jax plan``: per-device memory and FLOPs of a run, from its config and a mesh, before paying for it.

Nothing is allocated: the model's parameters come from ``nnx.eval_shape``, the optimizer state from
``jax.eval_shape``, and the two programs a run repeats are lowered and compiled ahead of time
(``jax.jit(...).lower(abstract args with NamedShardings).compile()``) on simulated CPU devices
(``--xla_force_host_platform_device_count=N``, set in a subprocess):

* the **train step**: ``stapo_jax.train.train_step.make_train_step`` on one mini-batch (``ppo_mini_batch_size x
  rollout.n`` sequences of ``max_prompt_length + max_new_tokens`` tokens, ``ppo_micro_batch_size`` sequences
  per device per micro-batch, the recipe's pre-pass, remat policy and optimizer) in the layout the trainer
  gives it (``stapo_jax.tools.plan_programs.train_batch_layout``): padded rows, or with
  ``model.use_remove_padding`` packed rows; where the update does not depend on a row's micro-batch, the slot
  layout of micro-batches chosen by tokens (``packing.token_budget_slots``) at its largest: ``n_max``
  sequences per micro-batch (``actor.max_sequences_per_micro_batch``), packed rows of one padded micro-batch's
  tokens (``stapo_jax.tools.plan_analytic.packed_slot_bound`` derives it);
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
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from stapo_jax.tools.plan_analytic import analytic
from stapo_jax.tools.plan_programs import PlanError, abstract_engine_spec, abstract_train_state, plan_decode, plan_train

__all__ = ["PlanError", "DEVICE_MEMORY_GB", "make_spec", "run_plan", "plan", "format_report", "main", "analytic",
           "abstract_train_state", "abstract_engine_spec", "plan_model_config", "fits", "build_parser"]

GiB = 1024 ** 3
GB = 1000 ** 3
PLANNED_PLATFORM = "tpu"  # how model.scan_unroll=auto resolves in a plan (an accelerator run: the rolled loop)
# HBM per device, decimal GB as vendors quote it (TPU v5p 95 GB, v6e 32 GB; H100 SXM 80 GB, H200 141 GB).
DEVICE_MEMORY_GB = {"tpu-v5p": 95.0, "tpu-v6e": 32.0, "tpu-v5e": 16.0, "tpu-v4": 32.0, "h100": 80.0, "h200": 141.0,
                    "a100": 80.0}


# --------------------------------------------------------------------------------------------- the spec


def plan_model_config(cfg, target_platform: Optional[str] = None) -> Any:
    """The ``Qwen3Config`` of ``cfg.model``; a hub id in ``model.path`` that is not a local directory is
    resolved by preset name (``Qwen/Qwen3-14B-Base`` -> preset ``Qwen3-14B-Base``) so no download happens.
    ``target_platform`` (``"tpu"`` / ``"gpu"``, ``--target``): the attention stays as configured (``auto`` then
    resolves from the target mesh's devices while tracing) and ``scan_unroll=auto`` resolves for that platform;
    None (simulated CPU devices): splash / cudnn are planned as blockwise.
    Raises PlanError (unknown hub id), CheckpointError (bad config.json). Source: HF ``config.json``."""
    import dataclasses as dc

    from models.layer_scan import resolve_scan_unroll
    from models.presets import canonical_name, preset
    from stapo_jax.runtime.build import model_config

    m = cfg.model
    # the plan compiles on CPU: auto resolves to blockwise there; the TPU/GPU kernels (splash, cudnn) are
    # planned with blockwise, which has the same O(T x block) attention memory. It plans an accelerator run, so
    # scan_unroll=auto is planned as there (1: the rolled loop); set an int to plan a CPU run's unroll
    attention = m.attention if target_platform else "blockwise" if m.attention in ("splash", "cudnn") else m.attention
    platform = target_platform or PLANNED_PLATFORM
    extra = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=attention,
                 scan_unroll=resolve_scan_unroll(m.scan_unroll, platform))
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
    return dc.replace(model_config(cfg, platform=platform), **extra)


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
              opt_state: str = "trainer", target: Optional[str] = None) -> dict:
    """A JSON-able plan spec from a run config (the input of :func:`run_plan`).

    Args:
      cfg: :class:`stapo_jax.config.schema.Config`.
      mesh: ``--mesh`` value (see :func:`_mesh_sizes`); None = ``cfg.mesh``.
      devices: device count (resolves a ``-1`` axis; checked against the mesh otherwise).
      hbm_gb: device memory in GB (decimal) for the fit verdict; default from the mesh preset's name.
      decode, train: which programs to plan.
      opt_state: ``"trainer"`` (the optimizer-state shardings ``TrainState.create`` produces: moments sharded
        like their parameters) or ``"replicated"`` (what-if); see :func:`abstract_train_state`.
      target: a ``stapo_jax.tools.targets.TARGETS`` name: compile every program of the run with that chip's real
        compiler (the mesh defaults to ``configs/mesh/<target>.yaml`` when it exists, else ``cfg.mesh``; its size
        must equal the target's chips); HBM and chip facts from the target.
    Returns:
      dict with ``model`` (Qwen3Config fields), ``mesh`` sizes, ``devices``, ``hbm_gb``, batch shapes, ``recipe``,
      optimizer and engine settings.
    Raises:
      PlanError: see :func:`_mesh_sizes`; the mini-batch does not split over the data shards and micro-batches.
    Int / float / bool / str fields. Source: verl's ``ppo_mini_batch_size`` / ``ppo_micro_batch_size``."""
    from stapo_jax.rollout import engine_config
    from stapo_jax.tools.targets import REPO, TargetError, get_target

    tgt = None
    if target is not None:
        try:
            tgt = get_target(target)
        except TargetError as e:
            raise PlanError(str(e)) from None
        if mesh is None and (REPO / "configs" / "mesh" / f"{target}.yaml").is_file():
            mesh = target
        devices = tgt.chips if devices is None else devices
    sizes, kind = _mesh_sizes(mesh, cfg, devices)
    n = math.prod(sizes.values())
    dp = sizes["data"] * sizes["fsdp"]
    from stapo_jax.config.schema import micro_batch_count
    from stapo_jax.config.selection import token_mask_name

    accum = micro_batch_count(cfg.actor.ppo_mini_batch_size * cfg.rollout.n, dp, cfg.actor.ppo_micro_batch_size)
    if accum is None:  # the trainer's rule (batch_shapes.check_batch_shapes)
        raise PlanError(f"actor.ppo_mini_batch_size x rollout.n = {cfg.actor.ppo_mini_batch_size * cfg.rollout.n} "
                        f"sequences do not split into {dp} data-parallel shards of micro-batches of "
                        f"actor.ppo_micro_batch_size={cfg.actor.ppo_micro_batch_size}: change one of them or mesh.*")
    qcfg = plan_model_config(cfg, tgt.platform if tgt else None)
    a = cfg.actor
    ecfg = engine_config(cfg)
    engine = {f.name: getattr(ecfg, f.name) for f in dataclasses.fields(ecfg) if f.name != "sampling"}
    if tgt is not None:
        hbm_gb = tgt.hbm_gb if hbm_gb is None else hbm_gb
        kind = tgt.name
    return {
        "target": dataclasses.asdict(tgt) if tgt else None,
        "engine": engine, "sampling": dataclasses.asdict(ecfg.sampling),
        "steps_per_sync": cfg.rollout.steps_per_sync, "ppo_epochs": a.ppo_epochs,
        "greedy_eval": bool(cfg.trainer.eval_every),  # held-out passes decode greedily (when a split exists)
        "model": dataclasses.asdict(qcfg),
        "mesh": sizes, "devices": n,
        "hbm_gb": hbm_gb if hbm_gb is not None else DEVICE_MEMORY_GB.get(kind) if kind else None,
        "device_kind": kind,
        "recipe": cfg.algorithm.recipe, "token_mask": token_mask_name(cfg),
        "s2t_scope": cfg.s2t.quantile_scope, "top_entropy_scope": cfg.top_entropy.scope,
        "mini_batch_sequences": a.ppo_mini_batch_size * cfg.rollout.n,
        "micro_batch_per_device": a.ppo_micro_batch_size, "num_micro_batches": accum,
        "updates_per_step": cfg.trainer.train_batch_size // a.ppo_mini_batch_size * a.ppo_epochs,
        "prompt_length": cfg.data.max_prompt_length, "response_length": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature, "seq_chunk": a.logprob_seq_chunk or 0,
        "vocab_chunk": a.logprob_vocab_chunk, "use_remove_padding": cfg.model.use_remove_padding,
        "max_sequences": a.sequences_cap(),
        "optim": dataclasses.asdict(a.optim),
        "use_kl": bool(a.use_kl_loss and a.kl_loss_coef > 0), "sampler_is": a.sampler_is != "off",
        "s2t_minibatch_method": cfg.s2t.minibatch_method,
        # the trainer hands the update the old-log-prob pass's entropies (stats_policy=old, correction mode)
        "old_stats": token_mask_name(cfg) == "s2t" and (cfg.s2t.stats_policy == "old"
                                                        or cfg.s2t.minibatch_method == "correction"),
        "decode_slots": cfg.rollout.max_concurrent_decodes,
        "rollout_sequences_per_step": cfg.trainer.train_batch_size * cfg.rollout.n,
        "plan_train": train, "plan_decode": decode, "opt_state": opt_state,
    }


def run_plan(spec: dict) -> dict:
    """Build and compile the planned programs in this process (which must see ``spec["devices"]`` devices).

    Returns:
      ``{"spec": spec, "train": {...}, "decode": {...}, "analytic": {...}}``; byte counts are per device.
    Raises:
      PlanError: this process sees a different number of devices.
    Int / float / str dicts. Source: XLA ``compiled.memory_analysis()`` / ``cost_analysis()``."""
    import jax

    from models.qwen3_config import Qwen3Config
    from models.sharding import make_mesh

    qcfg = Qwen3Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["model"].items()})
    if spec.get("target"):  # every program of the run, by the target's real compiler
        from stapo_jax.tools.plan_run import run_programs
        from stapo_jax.tools.targets import Target, compiler_version, target_devices

        tgt = Target(**spec["target"])
        mesh = make_mesh(**spec["mesh"], devices=target_devices(tgt))
        return {"spec": spec, "analytic": analytic(spec, qcfg), "compiler": compiler_version(tgt),
                **run_programs(spec, qcfg, mesh, target_devices(tgt, host=True) if tgt.hosts > 1 else None)}
    if len(jax.devices()) != spec["devices"]:
        raise PlanError(f"run_plan: this process has {len(jax.devices())} devices, the plan needs "
                        f"{spec['devices']} (use plan(), which simulates them in a subprocess)")
    mesh = make_mesh(**spec["mesh"])
    out = {"spec": spec, "analytic": analytic(spec, qcfg)}
    if spec.get("plan_train", True):
        out["train"] = plan_train(spec, qcfg, mesh)
    if spec.get("plan_decode", True):
        out["decode"] = plan_decode(spec, qcfg, mesh)
    return out


# ------------------------------------------------------------------------------------ subprocess + CLI


def plan(spec: dict, *, timeout_s: Optional[float] = None) -> dict:
    """:func:`run_plan` with ``spec["devices"]`` simulated CPU devices (or, with a target, its compiler's
    topology devices: ``targets.target_environment``), in a fresh subprocess.

    With a target, a compiler that aborts the process is recorded as the failing program's error and the compile
    goes on with the rest (``plan_run.Journal``).
    Raises:
      RuntimeError: the subprocess failed outside a compile (its output tail is in the message).
    Returns int / float / str dicts; ``timeout_s`` seconds, past it ``subprocess.TimeoutExpired``. Source: JAX
    ``--xla_force_host_platform_device_count``."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        if spec.get("target"):
            spec = dict(spec, journal=str(Path(tmp) / "journal.jsonl"))
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
                   + f" --xla_force_host_platform_device_count={spec['devices']}")
        if spec.get("target"):
            from stapo_jax.tools.targets import Target, target_environment

            env = target_environment(Target(**spec["target"]), env)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:  # a compiler abort costs one program, not the plan (plan_run.Journal); at most one per program
            left = None if deadline is None else max(deadline - time.monotonic(), 1.0)
            proc = subprocess.run([sys.executable, "-m", "stapo_jax.tools.plan", "--worker", str(spec_path),
                                   str(out_path)], env=env, capture_output=True, text=True, timeout=left)
            if proc.returncode == 0 and out_path.is_file():
                result = json.loads(out_path.read_text())
                result["spec"].pop("journal", None)
                return result
            tail = (proc.stdout + proc.stderr)[-4000:]
            crashed = None
            if spec.get("journal"):
                from stapo_jax.tools.plan_run import record_crash

                lines = tail.strip().splitlines() or ["?"]
                crashed = record_crash(spec["journal"], next((x for x in reversed(lines) if "Check failed" in x),
                                                             lines[-1]))
            if crashed is None:
                raise RuntimeError(f"plan subprocess failed (exit {proc.returncode}):\n{tail}")
            print(f"stapo-jax plan: the compiler aborted on {crashed!r} (exit {proc.returncode}); going on without it",
                  file=sys.stderr)


def _gb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def layout_line(layout: dict, spec: dict) -> str:
    """One report line on the planned train-step batch layout (``plan_programs.train_batch_layout``): for the
    token-budget slot layout, K', n_max, the slot rows and the packed geometry. Takes dicts of int / str, returns
    a str; raises KeyError for a layout not from ``train_batch_layout``. Source: ``packing.token_budget_slots``."""
    dp = spec["mesh"]["data"] * spec["mesh"]["fsdp"]
    w = layout["row_length"]
    if layout["kind"] == "padded":
        return f"train batch: {layout['rows']} padded rows of {w} tokens"
    if layout["kind"] == "packed rows":
        return (f"train batch: packed rows, worst case of one sequence per row ({layout['rows']} rows of {w} tokens; "
                f"the update depends on a row's micro-batch, so micro-batches are not chosen by tokens)")
    m_b = layout["sequences_per_padded_micro_batch"]
    return (f"train batch: micro-batches chosen by tokens (token budget {layout['budget_tokens']} tokens = "
            f"{m_b} padded row(s) of {w} per device), planned at the largest slot layout: "
            f"K'={layout['micro_batches']} micro-batches of n_max={layout['n_max']} sequence slots per device "
            f"(cap {spec['max_sequences']}: actor.max_sequences_per_micro_batch), {layout['rows']} slot rows "
            f"({layout['rows'] // dp} per device; padded: {spec['mini_batch_sequences'] // dp}), packed rows "
            f"{m_b} x {w} per micro-batch per device")


def format_report(result: dict) -> str:
    """Human-readable report of :func:`run_plan`'s result (per-device memory in GB = 1e9 bytes; FLOPs).
    Str out. Raises KeyError for a result not from :func:`run_plan`. Source: XLA ``memory_analysis``."""
    s, a = result["spec"], result["analytic"]
    m = s["model"]
    hbm = s.get("hbm_gb")
    lines = [
        f"model: L={m['num_hidden_layers']} D={m['hidden_size']} F={m['intermediate_size']} "
        f"heads={m['num_attention_heads']}/{m['num_key_value_heads']} V={m['vocab_size']} "
        f"tied={m['tie_word_embeddings']}  params={a['params'] / 1e9:.4g}B  dtype={m['dtype']} "
        f"param_dtype={m['param_dtype']} remat={m['remat']} scan_unroll={m.get('scan_unroll', 1)} "
        f"attention={m.get('attention', 'xla')}",
        f"mesh: {s['mesh']} = {s['devices']} devices"
        + (f" ({s['device_kind'] or 'device'}: {hbm:g} GB each)" if hbm else " (device memory unknown: pass --hbm-gb)"),
        f"recipe: {s['recipe']}  mini-batch {s['mini_batch_sequences']} sequences x {s['prompt_length']}+"
        f"{s['response_length']} tokens, {s['micro_batch_per_device']} per device per micro-batch, "
        f"{s['num_micro_batches']} micro-batches, {s['updates_per_step']} updates per step; "
        f"optimizer state: {s.get('opt_state', 'trainer')}; model.use_remove_padding: "
        + ("on" if s.get("use_remove_padding") else "off (padded rows)"),
        *([layout_line(result["train"]["layout"], s)] if "train" in result and "layout" in result["train"] else []),
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
    Bool / None (bytes as int / float); KeyError for a foreign result. Source: XLA memory_analysis."""
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
    Str / int / float options; never raises (bad arguments exit 2). Source: verl-style dotted overrides."""
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
    p.add_argument("--target", help="compile every program of the run with a real TPU / GPU compiler on this host: "
                                    "tpu-v5e-4, tpu-v4-32, tpu-v5p-64, tpu-v6e-64, tpu-v5e-256, gpu-2xh100, "
                                    "gpu-8xh100, gpu-8xh200, gpu-2x8xh100 (needs make setup-targets)")
    p.add_argument("--programs", choices=("all", "core"), default="all",
                   help="with --target: every program of the run (default), or core: the update programs, the largest "
                        "prefill bucket and KV-cache length, and the sync (the peaks and the prediction, faster)")
    p.add_argument("--program-cache", metavar="DIR",
                   help="with --target: keep each compiled program's figures in DIR, and take them from there for a "
                        "program whose lowered text, target and compiler match (marked cached; its compile seconds "
                        "are the first compile's)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="bound on the compile subprocess (seconds)")
    p.add_argument("--json", help="also write the full result as JSON here")
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``stapo-jax plan``; exit code 0 (fits or unknown memory), 1 (does not fit, or with ``--target`` a program
    failed to compile), 2 (bad input, missing target packages), 3 (the compile passed ``--timeout-s``).
    Argv str, int exit code; ConfigError / PlanError / TargetError / FileNotFoundError / KeyError exit 2, not
    raised."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.worker:
        spec = json.loads(Path(args.worker[0]).read_text())
        Path(args.worker[1]).write_text(json.dumps(run_plan(spec)))
        return 0
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError

    overrides = list(args.overrides)
    if args.model:
        is_path = Path(args.model).exists()
        overrides += ([f"model.path={args.model}", "model.preset=null"] if is_path
                      else [f"model.preset={args.model}", "model.path=null"])
    try:
        if (args.programs != "all" or args.program_cache) and not args.target:
            raise PlanError("--programs and --program-cache apply to the programs --target compiles; pass --target too")
        cfg = load_config(args.config, overrides)
        spec = make_spec(cfg, mesh=args.mesh, devices=args.devices, hbm_gb=args.hbm_gb,
                         train=args.only != "decode", decode=args.only != "train", opt_state=args.opt_state,
                         target=args.target)
        spec["programs"] = args.programs
        if args.program_cache:
            spec["program_cache"] = str(Path(args.program_cache).resolve())
        if args.target:
            from stapo_jax.tools.targets import check_packages, get_target

            check_packages(get_target(args.target))
    except (ConfigError, PlanError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"stapo-jax plan: {e}", file=sys.stderr)
        return 2
    try:
        result = plan(spec, timeout_s=args.timeout_s)
    except subprocess.TimeoutExpired:
        print(f"stapo-jax plan: the compile subprocess passed --timeout-s {args.timeout_s:g} s; stopped", file=sys.stderr)
        return 3
    if args.json:  # first: the result survives a report that cannot be printed (a closed pipe)
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.target:
        from stapo_jax.tools.plan_report import fits_programs, format_programs

        print(format_programs(result))
        ok = fits_programs(result)
    else:
        print(format_report(result))
        ok = fits(result)
    return 1 if ok is False else 0


if __name__ == "__main__":
    sys.exit(main())
