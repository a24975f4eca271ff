"""Every program of an RL run, compiled ahead of time at the run's shapes (``stapo-jax plan --target``).

With ``trainer.precompile`` (on for GPU / TPU) a run compiles a bounded set of programs in its warm-up and nothing
after it (``stapo_jax.train.precompile``). This module builds that same set from abstract arguments
(``jax.ShapeDtypeStruct`` with the run's ``NamedSharding``; nothing allocated, nothing executed) and compiles each
one, so a compiler for another chip can judge them:

* **update**, per packed geometry of ``packing.fixed_geometries`` (or the padded rows): the old-log-prob pass
  (``train_step.make_log_prob_fn``; the reference policy's pass, ``actor.use_kl_loss``, runs the same program)
  and the update step(s) of ``make_update_steps`` (two with S2T's ``prepass``);
* **rollout**, on the engine's mesh (the whole mesh in one process; one host's devices per process in a
  multi-host job, as ``rollout.multihost.local_mesh``): the prefill of every prefill bucket, and per KV-cache
  length the decode step (``rollout.steps_per_sync`` steps per call) and the insert of each prefill bucket that
  fits (``rollout.warmup``); cache resizes are one small copy per length pair and are not listed;
* **sync**: the per-layer copy of the trainer's stacked parameters into the engine's buffers (``set_params``);
* **eval**: the greedy decode step per KV-cache length (held-out passes), when the run evaluates.

``spec["programs"] = "core"`` (``plan --programs core``) keeps what sets each phase's peak memory and the
prediction: the update programs, the largest prefill bucket, the decode steps at the largest KV-cache length and
the weight sync (no inserts); the smaller buckets' programs are the same code at smaller shapes.

Each program's entry: compile seconds, XLA's memory analysis (argument / output / alias / temp / peak bytes per
device), cost analysis (FLOPs, bytes accessed, and on TPU the compiler's ``optimal_seconds``) and the count of
kernel custom calls (Mosaic ``tpu_custom_call``, cuDNN ``__cudnn$fmha*``). A program that fails to compile gets its
error line and the others still compile.

With ``spec["program_cache"]`` (``plan --program-cache DIR``) a program whose lowered text matches one compiled
before for the same target, compiler and compiler flags takes that compile's entry (``"cached": true``, its
``compile_s`` the original compile's): the rollout programs of two recipes that differ only in the loss compile
once. Compiled executables cannot be kept across processes here (a deviceless compiler cannot load one), so only
the figures are.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Optional

from stapo_jax.tools.plan_analytic import spec_optimizer, spec_policy_update, spec_recipe

__all__ = ["Journal", "JOURNAL", "ProgramCache", "PROGRAM_CACHE", "record_crash", "compile_program", "engine_mesh", "prefill_buckets", "update_programs", "rollout_programs", "run_programs"]

_PARTITIONER_PTR = re.compile(r'(@CustomSPMDPartitioning\([^)]*\) \{api_version = \d+ : i32, backend_config = )"\d+"')
_KERNEL_RE = re.compile(r'custom_call_target="(tpu_custom_call|__cudnn\$fmha[A-Za-z]*)"')


def _cost(compiled) -> dict:
    """FLOPs, bytes accessed and (TPU) optimal seconds of a compiled program; GPU executables report none, so
    XLA's HLO cost analysis runs on the optimized module with the host client (cuDNN calls count 0 FLOPs)."""
    ca = None
    try:
        ca = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        ca = None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else None
    if not ca:
        try:
            import jax
            from jax._src.lib import xla_client

            module = compiled.runtime_executable().hlo_modules()[0]
            ca = xla_client._xla.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
        except Exception:  # noqa: BLE001 - cost figures are optional
            ca = {}
    opt = ca.get("optimal_seconds")
    return {"flops": float(ca.get("flops", 0.0) or 0.0), "bytes_accessed": float(ca.get("bytes accessed", 0.0) or 0.0),
            "optimal_seconds": float(opt) if opt is not None and opt > 0 else None}


class Journal:
    """The programs of one plan compiled so far, as a JSONL file (``{"start": name}`` before each compile, the
    entry after it). A compiler that aborts the process (a C++ ``Check failed``) leaves a start without an entry:
    ``plan.plan`` records it as that program's error (:func:`record_crash`) and restarts the compile, which takes
    the entries already made from here and goes on past the crashed program. Without a path it records nothing."""

    def __init__(self):
        self.path: Optional[Path] = None
        self.entries: dict[str, dict] = {}

    def open(self, path: Optional[str]) -> None:
        """Start journalling into ``path`` (None: off), reading the entries a previous attempt left there."""
        self.path, self.entries = (Path(path) if path else None), {}
        if self.path and self.path.is_file():
            for line in self.path.read_text().splitlines():
                rec = json.loads(line)
                if "name" in rec:
                    self.entries[rec["name"]] = rec

    def reuse(self, name: str) -> Optional[dict]:
        """The entry of ``name`` from a previous attempt: a failure, or a success whose compiled program no
        later program needs (a prefill's output shardings feed the inserts, so prefills compile again)."""
        rec = self.entries.get(name)
        if rec is None or ("error" not in rec and name.startswith("prefill")):
            return None
        return rec

    def write(self, rec: dict) -> None:
        """Append one record (flushed at once, so it survives an abort of the process)."""
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(rec) + "\n")


JOURNAL = Journal()


class ProgramCache:
    """Entries of programs compiled before, kept in a directory as ``<sha256>.json`` and keyed by the lowered
    program's text plus ``salt`` (target, compiler version, compiler flags). Without a directory it keeps
    nothing."""

    def __init__(self):
        self.path: Optional[Path] = None
        self.salt = ""

    def open(self, path: Optional[str], salt: str) -> None:
        """Use directory ``path`` (None: off; created if missing) with key ``salt``. Raises OSError when the
        directory cannot be created."""
        self.path, self.salt = (Path(path) if path else None), salt
        if self.path:
            self.path.mkdir(parents=True, exist_ok=True)

    def key(self, text: str) -> str:
        """The hex sha256 of ``salt`` and a lowered program's text, without the process-local address a
        ``custom_partitioning`` call (cuDNN attention) carries as its backend config (as jax's own cache key
        drops it)."""
        text = _PARTITIONER_PTR.sub(r'\1""', text)
        return hashlib.sha256((self.salt + "\0" + text).encode()).hexdigest()

    def get(self, key: str) -> Optional[dict]:
        """The entry stored under ``key``, or None (off, absent, or unreadable)."""
        f = self.path / f"{key}.json" if self.path else None
        try:
            return json.loads(f.read_text()) if f and f.is_file() else None
        except (OSError, ValueError):
            return None

    def put(self, key: str, entry: dict) -> None:
        """Store a successful compile's ``entry`` under ``key`` (written whole, then renamed into place)."""
        if self.path and "error" not in entry:
            tmp = self.path / f".{key}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(entry))
            tmp.replace(self.path / f"{key}.json")


PROGRAM_CACHE = ProgramCache()


def record_crash(path: str, message: str) -> Optional[str]:
    """After the compile process died: the program it had started and not finished gets the entry ``{"name",
    "phase", "error": "compiler crashed: <message>"}`` in the journal at ``path``; returns its name, or None
    when no program was in progress (the crash is then not a compile's). Never raises for a readable file.
    Source: this module's :class:`Journal` format."""
    p = Path(path)
    started, done = None, set()
    if p.is_file():
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            if "start" in rec:
                started = rec
            elif "name" in rec:
                done.add(rec["name"])
    if started is None or started["start"] in done:
        return None
    with p.open("a") as f:
        f.write(json.dumps({"name": started["start"], "phase": started["phase"], "compile_s": 0.0,
                            "error": f"compiler crashed: {message[:400]}"}) + "\n")
    return started["start"]


def compile_program(name: str, phase: str, lower: Callable[[], object]) -> tuple[dict, Optional[object]]:
    """Lower (``lower()`` returns a ``jax.stages.Lowered``) and compile one program, timing both.

    Returns ``(entry, compiled)``: entry holds ``name``, ``phase``, ``compile_s`` (float seconds, lowering
    included), ``memory`` (int bytes per device: argument / output / alias / temp / generated_code / peak =
    argument + output - alias + temp), ``cost`` (see :func:`_cost`) and ``kernels`` (custom-call counts by target);
    on failure ``error`` (the exception's type and first line) and compiled None. Never raises for a compile
    error. With :data:`JOURNAL` open, a program a previous attempt compiled or crashed on is taken from it; with
    :data:`PROGRAM_CACHE` open, a program compiled before with the same lowered text is taken from there
    (``cached: true``), except a prefill, whose compiled output shardings the inserts need.
    Source: JAX AOT ``jit(f).lower(...).compile()``, ``memory_analysis`` / ``cost_analysis``."""
    previous = JOURNAL.reuse(name)
    if previous is not None:
        return previous, None
    JOURNAL.write({"start": name, "phase": phase})
    t0 = time.perf_counter()
    try:
        lowered = lower()
        key = PROGRAM_CACHE.key(lowered.as_text()) if PROGRAM_CACHE.path and not name.startswith("prefill") else None
        hit = PROGRAM_CACHE.get(key) if key else None
        if hit is not None:
            entry = dict(hit, name=name, phase=phase, cached=True)
            JOURNAL.write(entry)
            return entry, None
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - reported per program; the other programs still compile
        msg = str(e).strip().splitlines()
        entry = {"name": name, "phase": phase, "compile_s": time.perf_counter() - t0,
                 "error": f"{type(e).__name__}: {msg[0][:400] if msg else ''}"}
        JOURNAL.write(entry)
        return entry, None
    secs = time.perf_counter() - t0
    m = compiled.memory_analysis()
    mem = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp",
                                                              "generated_code")}
    mem["peak"] = mem["argument"] + mem["output"] - mem["alias"] + mem["temp"]
    kernels: dict[str, int] = {}
    for k in _KERNEL_RE.findall(compiled.as_text() or ""):
        kernels[k] = kernels.get(k, 0) + 1
    entry = {"name": name, "phase": phase, "compile_s": secs, "memory": mem, "cost": _cost(compiled),
             "kernels": kernels}
    JOURNAL.write(entry)
    if key:
        PROGRAM_CACHE.put(key, entry)
    return entry, compiled


def engine_mesh(mesh, host_devices, tensor: int):
    """The rollout engine's mesh: ``mesh`` itself in a one-process job (``host_devices`` None); otherwise one
    host's devices, shaped as ``rollout.multihost.local_mesh`` shapes them (``tensor`` when it divides the host's
    devices, else 1; the rest on ``fsdp``). Returns a ``jax.sharding.Mesh``; raises ShardingError from
    ``make_mesh`` for sizes that do not fit. Source: JetStream / MaxEngine, one engine per host."""
    from models.sharding import make_mesh

    if host_devices is None:
        return mesh
    n = len(host_devices)
    t = tensor if tensor > 0 and n % tensor == 0 else 1
    return make_mesh(data=1, fsdp=n // t, tensor=t, devices=list(host_devices))


def _update_batch(spec: dict, mesh, rows: int, geometry, k: int):
    """The abstract ``Batch`` of one mini-batch as ``policy_update.update_policy`` places it (``old_entropy`` always
    present, as the trainer passes it; a ``PackedLayout`` of ``[K * S * M, L]`` rows for a packed geometry)."""
    import jax
    import jax.numpy as jnp

    from stapo_jax.train.packing import PackedLayout
    from stapo_jax.train.train_step import Batch, batch_sharding

    bs = batch_sharding(mesh)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    p, r = spec["prompt_length"], spec["response_length"]
    sd = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=bs)  # noqa: E731
    f32 = lambda: sd((rows, r), jnp.float32)  # noqa: E731
    packing = None
    if geometry is not None:
        m, length = geometry
        packed = (k * dp * m, length)
        packing = PackedLayout(sd(packed, jnp.int32), sd(packed, jnp.int32), sd(packed, jnp.int32),
                               sd((rows, r), jnp.int32), num_shards=dp)
    return Batch(input_ids=sd((rows, p + r), jnp.int32), attention_mask=sd((rows, p + r), jnp.bool_),
                 response_mask=sd((rows, r), jnp.bool_), advantages=sd((rows,), jnp.float32), old_log_probs=f32(),
                 ref_log_probs=f32() if spec["use_kl"] else None,
                 rollout_log_probs=f32() if spec["sampler_is"] else None, old_entropy=f32(), packing=packing)


def _geometries(spec: dict, qcfg, mesh) -> list:
    """The packed ``(M, L)`` geometries of the run's update (``micro_batches.update_geometries``), or ``[None]``."""
    import jax

    from models.attention import resolve_implementation
    from stapo_jax.train.packing import packing_long_rows
    from stapo_jax.train.micro_batches import update_geometries

    if not spec["use_remove_padding"]:
        return [None]
    with jax.set_mesh(mesh):  # the attention the target runs decides whether packed rows may be long
        long_rows = packing_long_rows(resolve_implementation(qcfg.attention, qcfg.dtype))
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    return update_geometries(spec["mini_batch_sequences"], spec["num_micro_batches"], dp,
                             spec["prompt_length"] + spec["response_length"], long_rows)


def _largest_geometry(spec: dict, qcfg, mesh):
    return _geometries(spec, qcfg, mesh)[-1]


def update_programs(spec: dict, qcfg, mesh, state, shardings) -> list[tuple[dict, object]]:
    """Compile the update phase's programs (module docstring) for the abstract train ``state`` / ``shardings``
    (``plan_programs.abstract_train_state``). Returns ``[(entry, compiled)]`` as :func:`compile_program`.
    Raises KeyError for a spec not from ``plan.make_spec``; compile errors are entries. Source: the trainer's
    ``PolicyUpdate`` with ``trainer.precompile`` (``micro_batches.update_geometries``)."""
    import jax

    rows, k, r = spec["mini_batch_sequences"], spec["num_micro_batches"], spec["response_length"]
    geometries = _geometries(spec, qcfg, mesh)
    first, rest, log_prob = spec_policy_update(spec, qcfg, mesh, shardings).programs(k)
    out = []
    for g in geometries:
        batch = _update_batch(spec, mesh, rows, g, k)
        tag = "padded rows" if g is None else f"packed {g[0]}x{g[1]}"
        with jax.set_mesh(mesh):
            out.append(compile_program(f"old log-probs ({tag})", "update", lambda b=batch: log_prob.lower(
                state.params, state.graphdef, b.input_ids, b.attention_mask, r, b.packing)))
            steps = [("update step, first mini-batch", first), ("update step", rest)] if first is not rest \
                else [("update step", rest)]
            for name, fn in steps:
                out.append(compile_program(f"{name} ({tag})", "update", lambda f=fn, b=batch: f.lower(state, b)))
    return out


def unit_programs(spec: dict, qcfg, mesh, geometry, dparams_fn=None) -> list[tuple[dict, object]]:
    """Loop-free programs whose count per RL step is known, for the predicted step time (phase ``"unit"``; not
    programs of the run): one micro-batch's old-log-prob pass and update step (K = 1, the rows of one micro-batch,
    at ``geometry``, the largest packed ``(M, L)`` or None for padded rows), each for a model of 1 and of 2 decoder
    layers unrolled (``scan_unroll`` = layers) and the LM head in one chunk, so the compiler's cost model sees every
    operation once: ``t(L layers) = t1 + (L - 1) (t2 - t1)``. XLA's cost analysis counts a loop body once, so the
    run's own programs (layer scan, micro-batch map) cannot give it. Returns ``[(entry, compiled)]`` named
    ``"unit: old log-probs, N layer(s)"`` / ``"unit: update step, N layer(s)"``. S2T's ``correction`` method
    redoes a micro-batch whose provisional threshold was wrong, under a conditional whose both branches XLA's cost
    model counts (twice the usual work); its unit is the usual path, no micro-batch redone: the same update with
    the mask from the old policy's statistics (``s2t.stats_policy=old``), the conditional's other branch. Raises
    KeyError for a spec not from ``plan.make_spec``. Source: XLA cost analysis (``optimal_seconds`` on TPU)."""
    import dataclasses

    import jax

    from stapo_jax.algo.s2t import minibatch_stats_mode
    from stapo_jax.tools.plan_programs import abstract_train_state

    if minibatch_stats_mode(spec_recipe(spec), spec["old_stats"]) == "correction":
        spec = dict(spec, s2t_stats_policy="old")
    k, r = spec["num_micro_batches"], spec["response_length"]
    rows = spec["mini_batch_sequences"] // k
    out = []
    for layers in (1, 2):
        ucfg = dataclasses.replace(qcfg, num_hidden_layers=layers, scan_unroll=layers)
        state, shardings = abstract_train_state(ucfg, spec_optimizer(spec), mesh, spec.get("opt_state", "trainer"))
        _, rest, log_prob = spec_policy_update(spec, ucfg, mesh, shardings, seq_chunk=r, vocab_chunk=None).programs(1)
        batch = _update_batch(spec, mesh, rows, geometry, 1)  # one micro-batch: S x M packed rows
        tag = f"{layers} layer{'s' if layers > 1 else ''}"
        with jax.set_mesh(mesh):
            out.append(compile_program(f"unit: old log-probs, {tag}", "unit", lambda b=batch, s=state, f=log_prob:
                                       f.lower(s.params, s.graphdef, b.input_ids, b.attention_mask, r, b.packing)))
            out.append(compile_program(f"unit: update step, {tag}", "unit", lambda b=batch, s=state, f=rest:
                                       f.lower(s, b)))
    return out


def _abstract_like(shapes, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def prefill_buckets(max_prefill_length: int) -> list[int]:
    """The engine's prefill buckets (``Qwen3Engine.prefill_bucket``: powers of two from 16, capped at
    ``max_prefill_length``), ascending ints. Never raises. Source: JetStream's prefill padding buckets."""
    out, b = [], 16
    while True:
        out.append(min(b, max_prefill_length))
        if b >= max_prefill_length:
            return out
        b *= 2


def rollout_programs(spec: dict, qcfg, emesh, params, dparams) -> list[tuple[dict, object]]:
    """Compile the rollout, sync and eval programs (module docstring) on the engine mesh ``emesh``: ``params``
    the abstract stacked parameters (``NamedSharding`` on ``emesh``; the sync's source), ``dparams`` the engine's
    per-layer copy of them (``decode_fns.as_decode_params``). Returns ``[(entry, compiled)]``. Raises KeyError
    for a spec not from ``plan.make_spec``; compile errors are entries. Source: ``rollout.warmup`` (the driver's
    program set) and ``Qwen3Engine.set_params``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.decode import LAYERS_KEY, copy_layer_into
    from stapo_jax.rollout import engine as eng
    from stapo_jax.rollout.decode_fns import abstract_decode_spec, init_fn, insert_fn, kv_length_buckets, \
        prefill_fn, step_fn
    from stapo_jax.rollout.sampling import SamplingParams

    ecfg = eng.EngineConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec["engine"].items()},
                            sampling=SamplingParams(**spec["sampling"]))
    key = jax.eval_shape(lambda: jax.random.key(0))  # made outside the mesh: nothing runs on the target
    espec = abstract_decode_spec(_graphdef(qcfg), qcfg, ecfg, emesh, eng.engine_stop_ids(qcfg, ecfg))
    rep = NamedSharding(emesh, P())
    scalar = lambda shape=(), dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=rep)  # noqa: E731
    lengths = kv_length_buckets(ecfg.cache_length) if ecfg.kv_cache_buckets else (ecfg.cache_length,)
    buckets = prefill_buckets(ecfg.max_prefill_length)
    if spec.get("programs", "all") == "core":  # what sets the peaks and the prediction: the largest shapes only
        lengths, buckets = lengths[-1:], buckets[-1:]
    samplings = [("decode", "rollout", ecfg.sampling)] + (
        [("greedy decode", "eval", SamplingParams(greedy=True))] if spec.get("greedy_eval") else [])
    n_steps = int(spec.get("steps_per_sync", 1))
    out, prefixes = [], {}
    with jax.set_mesh(emesh):
        for bucket in buckets:
            rows = max(1, min(ecfg.prefill_batch_size, ecfg.prefill_batch_tokens // bucket))
            args = (scalar((rows, bucket)), scalar((rows,)), scalar((rows,), jnp.bool_))
            lowered = []
            entry, compiled = compile_program(f"prefill {rows}x{bucket}", "rollout", lambda a=args: lowered.append(
                prefill_fn.lower(espec, dparams, *a)) or lowered[-1])
            out.append((entry, compiled))
            if compiled is not None:
                prefixes[bucket] = _abstract_like(lowered[-1].out_info, compiled.output_shardings)
        for length in lengths:
            state = _abstract_like(jax.eval_shape(lambda k, n=length: init_fn(espec, k, n), key), espec.state_shardings)
            for label, phase, sampling in samplings:
                out.append(compile_program(f"{label} step x{n_steps}, KV {length}", phase, lambda s=state, sp=sampling:
                                           step_fn.lower(espec, dparams, s, sp, n_steps)))
            if length == lengths[-1] and spec.get("plan_units", True):  # one token, no scan: for the prediction
                out.append(compile_program(f"unit: decode step x1, KV {length}", "unit", lambda s=state:
                                           step_fn.lower(espec, dparams, s, ecfg.sampling, 1)))
            for bucket, prefix in prefixes.items():
                if bucket <= length and spec.get("programs", "all") == "all":
                    out.append(compile_program(f"insert {bucket} -> KV {length}", "rollout", lambda p=prefix, s=state:
                                               insert_fn.lower(espec, p, s, scalar(), scalar(), scalar(), scalar())))
        copy = jax.jit(functools.partial(copy_layer_into, kernel_layout=espec.kernel_layout), donate_argnums=2,
                       out_shardings=jax.tree.map(lambda x: x.sharding, dparams.layers[0]))
        out.append(compile_program("weight sync, one layer (x L)", "sync",
                                   lambda: copy.lower(params[LAYERS_KEY], scalar(), dparams.layers[0])))
    return out


@functools.lru_cache(maxsize=4)
def _graphdef(qcfg):
    from flax import nnx

    from models.qwen3 import Qwen3

    return nnx.split(nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(0))))[0]


def run_programs(spec: dict, qcfg, mesh, host_devices=None) -> dict:
    """Compile every program of the run on ``mesh`` (module docstring). Returns ``{"programs": [entry, ...],
    "engine_devices": int, "resident": {...}}`` with the bytes per device that stay allocated across phases:
    ``trainer_state`` (parameters + optimizer state), ``trainer_params`` and ``engine_params`` (the engine's
    per-layer copy, on its mesh). ``host_devices``: one host's devices in a multi-host job (the engine's mesh,
    :func:`engine_mesh`), None in one process. Raises PlanError / KeyError for a bad spec; compile errors are
    entries.
    Source: the trainer's warm-up program set (``stapo_jax.train.precompile``)."""
    from models.decode import decode_layer_dtype
    from stapo_jax.rollout.decode_fns import as_decode_params, resolve_kernel_layout
    from stapo_jax.tools.plan_programs import abstract_params, abstract_train_state, shard_bytes

    JOURNAL.open(spec.get("journal"))
    if spec.get("program_cache"):
        from stapo_jax.tools.targets import Target, compiler_version

        flags = " ".join(os.environ.get(v, "") for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS"))
        PROGRAM_CACHE.open(spec["program_cache"], f"{spec['target']['name']}|"
                                                  f"{compiler_version(Target(**spec['target']))}|{flags}")
    state, shardings = abstract_train_state(qcfg, spec_optimizer(spec), mesh, spec.get("opt_state", "trainer"))
    emesh = engine_mesh(mesh, host_devices, spec["mesh"]["tensor"])
    eparams = abstract_params(qcfg, emesh)[1]
    dparams = as_decode_params(eparams, resolve_kernel_layout(spec["engine"]["kernel_layout"], emesh),
                               decode_layer_dtype(qcfg))
    results = []
    if spec.get("plan_train", True):
        results += update_programs(spec, qcfg, mesh, state, shardings)
        if spec.get("plan_units", True):
            geometry = _largest_geometry(spec, qcfg, mesh)
            results += unit_programs(spec, qcfg, mesh, geometry)
    if spec.get("plan_decode", True):
        results += rollout_programs(spec, qcfg, emesh, eparams, dparams)
    return {"programs": [e for e, _ in results], "engine_devices": int(emesh.size),
            "resident": {"trainer_state": shard_bytes(state.params) + shard_bytes(state.opt_state),
                         "trainer_params": shard_bytes(state.params), "engine_params": shard_bytes(dparams)}}
