"""Where a decode step's time goes, from what a CPU can show (issue 33, item 5): the compiled program of one
engine decode step against the bytes it must read, the host round trips of the rollout driver per decode step,
its Python time per step, and the compiles a refilled slot triggers.

1. **HLO bytes.** ``decode_fns.step_fn`` (one step, what ``Qwen3Engine.step`` runs) is lowered and compiled from
   abstract arguments (no weights allocated: the 0.6B shape compiles on a laptop) for ``--batch`` slots and a
   ``--kv-length`` cache. Its bytes are summed over the optimized HLO's top-level instructions (operands + result,
   the rule of XLA's ``HloCostAnalysis``; ``compiled.cost_analysis()["bytes accessed"]`` is printed beside it)
   with two corrections, both for ops XLA runs in place or partially: a scatter / dynamic-update-slice (or a
   fusion holding one) whose result has the shape of one of its operands updates that buffer in place and counts
   twice its other operands, not the whole buffer twice (the KV-cache write of the new token into the donated,
   ``input_output_alias``-ed cache; HloCostAnalysis counts a fused scatter as a full copy), and a gather counts
   its result, not the table (the embedding lookup). ``ratio`` = those bytes over the bytes
   that must be read: every weight once plus the whole live KV cache (``[B, Nkv, S, H]`` per layer for K and V:
   a step attends over every cache position). The biggest contributors are printed by kind.
   ``unbounded loops`` counts ``while`` loops without a known trip count: XLA:GPU copies such a loop's
   predicate to the host on every iteration (a host round trip inside the step). Loops with a known trip count
   count their body once per trip; XLA:CPU's rolled threefry loop (jax's CPU lowering of the PRNG; GPU/TPU get
   unrolled, fusible code) is counted as one write of its bits in the ratio, and per trip in the second figure.
   The insert of one prefix row into a slot (``decode_fns.insert_fn``) is compiled too: its bytes against a copy
   of the cache show whether the donated cache is updated in place.
2. **Host round trips and host calls.** The :class:`~stapo_jax.rollout.driver.RolloutDriver` samples ``--rows``
   responses on a concrete model under ``jax.transfer_guard_device_to_host("disallow")`` (an implicit device->host read,
   ``int(x)`` / ``np.asarray(x)``, would raise) with ``jax.device_get`` counted; round trips per decode step
   and per generated token are printed (goal: at most ``1 / steps_per_sync`` per step), with the count and mean
   wall time of each engine call the driver makes (insert, multi_step, prefill, resize: dispatch cost per call).
3. **Python time.** Wall time of the driver per decode step, and its host share (wall minus the time spent
   waiting in ``device_get``), at the run's shape (a tiny model shows the per-step host cost).
4. **Recompiles on refill.** A second ``generate`` (another seed and other prompt tokens, same prompt lengths,
   sampled at T=1 with an EOS id, so rows end at different steps and finished slots are refilled at other
   times) after a warm-up one; backend compiles are counted through ``jax.monitoring`` and attributed to the
   engine call that triggered them (insert, step, prefill, resize). Goal: 0.

Defaults are a tiny shape that runs on a CPU in well under a minute; ``--preset qwen3-0.6b`` takes the Qwen3-0.6B
shape (bf16, 256 slots, 512-position cache: the issue's H200 rollout) for a GPU; ``--hlo-only`` skips parts 2-4
(the 0.6B HLO on a CPU). ``--check`` exits 1 when a goal is missed (ratio <= ``--max-ratio``, round trips, 0
recompiles, 0 unbounded loops, KV cache donated, insert in place).

    PYTHONPATH=. python bench/bench_decode_step.py                         # tiny, CPU, < 1 min
    PYTHONPATH=. python bench/bench_decode_step.py --preset qwen3-0.6b --hlo-only --dtype float32   # CPU
    python bench/bench_decode_step.py --preset qwen3-0.6b                  # GPU
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import re
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchutil import load_line, machine_line  # noqa: E402
from models.presets import preset  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from models.qwen3_config import Qwen3Config  # noqa: E402
from models.kv_cache import init_cache  # noqa: E402
from models.sharding import make_mesh, param_shardings  # noqa: E402
from stapo_jax.rollout import decode_fns  # noqa: E402
from stapo_jax.rollout.driver import RolloutDriver  # noqa: E402
from stapo_jax.rollout.engine import EngineConfig, Qwen3Engine  # noqa: E402
from stapo_jax.rollout.sampling import SamplingParams  # noqa: E402
from stapo_jax.runtime.compile_stats import CompileStats  # noqa: E402

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "s64": 8, "u64": 8,
               "f64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([0-9,]*)\]")
COMP_RE = re.compile(r"^(ENTRY )?%?([\w.\-]+) \((.*)\) -> .*\{$")
INSTR_RE = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")
FREE_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}
IN_PLACE_OPS = {"scatter", "dynamic-update-slice"}
# jax lowers threefry2x32 to a rolled 5-trip loop on CPU only (jax/_src/random/threefry2x32.py; unrolled
# elementwise code on GPU/TPU, fused with its consumer): "device" bytes count such a loop as one write of its bits.
PRNG_LOOP_RE = re.compile(r'op_name="[^"]*(?:_uniform|threefry|random_bits)[^"]*/while"')


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (an HLO type such as ``(f32[2,3], s32[])``)."""
    return sum(DTYPE_BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for dt, dims in SHAPE_RE.findall(text))


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list
    attrs: str


def parse_hlo(text: str):
    """(computations {name: [Instr]}, entry name, {value name: shape text}, aliased entry parameter names) of an
    optimized HLO module's text (``compiled.as_text()``)."""
    comps, shapes, entry, cur = {}, {}, None, None
    for line in text.splitlines():
        m = COMP_RE.match(line)
        if m:
            cur = m.group(2)
            comps[cur] = []
            if m.group(1):
                entry = cur
                params = [p.group(1) for p in re.finditer(r"([\w.\-]+): ", m.group(3))]
            for p in re.finditer(r"([\w.\-]+): ((?:\([^)]*\))|\w+\[[0-9,]*\])", m.group(3)):
                shapes[p.group(1)] = p.group(2)
            continue
        m = INSTR_RE.match(line.strip()) if cur else None
        if m:
            name, shape, opcode, rest = m.groups()
            args = rest.split("), ", 1)[0] if opcode != "constant" else ""
            shapes[name] = shape
            comps[cur].append(Instr(name, shape, opcode, re.findall(r"%([\w.\-]+)", args), rest))
    header = text.split("\n", 1)[0]  # "HloModule ..., input_output_alias={ {0}: (24, {}, may-alias), ... }, ..."
    donated = {params[int(i)] for i in re.findall(r"\{[\d,]*\}: \((\d+), \{", header)}
    return comps, entry, shapes, donated


def hlo_bytes(text: str) -> dict:
    """Bytes a compiled program moves (see the module docstring), from its optimized HLO ``text``.

    Returns ``{"bytes", "by_kind": Counter, "unbounded_loops"}``: ``bytes`` with the in-place and gather
    corrections, ``by_kind`` keyed by the op's source (the jax op name it came from) and result dtype/shape."""
    comps, entry, shapes, donated = parse_hlo(text)
    by_kind: collections.Counter = collections.Counter()
    unbounded, prng_extra = 0, [0]

    def walk(comp, times=1):
        nonlocal unbounded
        for ins in comps[comp]:
            if ins.opcode in FREE_OPS:
                continue
            called = re.search(r"(?:calls|to_apply|body)=%?([\w.\-]+)", ins.attrs)
            if ins.opcode in ("while", "call"):
                trips = re.search(r'known_trip_count":\{"n":"(\d+)"', ins.attrs)
                unbounded += ins.opcode == "while" and trips is None
                n = times * (int(trips.group(1)) if trips else 1)
                if ins.opcode == "while" and PRNG_LOOP_RE.search(ins.attrs):  # XLA:CPU's rolled threefry
                    before = sum(by_kind.values())
                    walk(called.group(1), n)
                    prng_extra[0] += sum(by_kind.values()) - before - shape_bytes(ins.shape) * times
                else:
                    walk(called.group(1), n)
                continue
            inner = {i.opcode for i in comps.get(called.group(1), [])} if called and ins.opcode == "fusion" else set()
            ops = inner | {ins.opcode}
            operand = [shape_bytes(shapes.get(o, "")) for o in ins.operands]
            out = shape_bytes(ins.shape)
            same = [k for k, o in enumerate(ins.operands) if shapes.get(o, "").split("{")[0] == ins.shape.split("{")[0]]
            if ops & IN_PLACE_OPS and same:  # the buffer is updated in place: the rest is read, then written
                total = 2 * (sum(operand) - operand[same[0]])
            elif "gather" in ops and operand:
                big = int(np.argmax(operand))
                total = out * 2 + sum(operand) - operand[big]  # the rows read, not the table
            else:
                total = out + sum(operand)
            source = re.search(r'op_name="([^"]*)"', ins.attrs)
            src = re.sub(r"\.\d+$", "", source.group(1).split("/")[-1]) if source else ins.opcode
            where = "model" if source and "decode_step" in source.group(1) else "sampling/state"
            by_kind[f"{where}: {src} -> {re.sub(r'{.*', '', ins.shape)[:40]}"] += total * times

    walk(entry)
    total = sum(by_kind.values())
    return {"bytes": total, "device_bytes": total - prng_extra[0], "by_kind": by_kind, "unbounded_loops": unbounded,
            "donated": donated}


def model_config(name: str, dtype: str) -> Qwen3Config:
    """The bench's model shapes: ``qwen3-0.6b`` (the real preset) or ``tiny`` (2 layers, D=128, V=512), whose
    proportions follow the 0.6B decode step's: head_dim / GQA group 32 (0.6B: 64), the logits a few % of the live
    KV, a 3x MLP."""
    if name == "tiny":
        return Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                           eos_token_id=None, bos_token_id=None, pad_token_id=0, tie_word_embeddings=True,
                           dtype=dtype, param_dtype=dtype)
    if name == "qwen3-0.6b":
        return dataclasses.replace(preset("Qwen3-0.6B"), dtype=dtype, param_dtype=dtype)
    raise SystemExit(f"--preset must be tiny or qwen3-0.6b, got {name!r}")


def step_cost(cfg: Qwen3Config, batch: int, kv_length: int, sampling: SamplingParams) -> dict:
    """Compile one decode step from abstract arguments and measure its bytes (part 1 of the module docstring)."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                         param_shardings(state, mesh))
    ecfg = EngineConfig(max_concurrent_decodes=batch, max_prefill_length=16, max_decode_length=kv_length - 16,
                        sampling=sampling)
    spec = decode_fns.abstract_decode_spec(graphdef, cfg, ecfg, mesh, (cfg.vocab_size - 1,))
    dstate = jax.eval_shape(functools.partial(decode_fns.init_fn, spec, length=kv_length), jax.random.key(0))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        compiled = decode_fns.step_fn.lower(spec, state, dstate, sampling, 1).compile()
    compile_s = time.perf_counter() - t0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    kv = sum(x.size * x.dtype.itemsize for x in dstate.cache.k + dstate.cache.v)
    res = hlo_bytes(compiled.as_text())
    rows = ecfg.prefill_batch_size  # insert: one row of a batched prefix ([k, Nkv, 16, H]) into one slot
    prefix = jax.eval_shape(lambda: decode_fns.Prefix(
        cache=init_cache(cfg, rows, 16), next_token=jnp.zeros(rows, jnp.int32), valid=jnp.zeros(rows, bool)))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    with jax.set_mesh(mesh):
        insert = decode_fns.insert_fn.lower(spec, prefix, dstate, scalar, scalar, scalar, scalar).compile()
    insert_text = insert.as_text()
    row = sum(x.size * x.dtype.itemsize for x in prefix.cache.k + prefix.cache.v) // rows
    kv_params = [n for n in parse_hlo(compiled.as_text())[3] | {"-"} if re.match(r"state_cache_[kv]_\d+_", n)]
    return dict(res, weights=weights, kv=kv, ratio=res["bytes"] / (weights + kv),
                device_ratio=res["device_bytes"] / (weights + kv), compile_s=compile_s,
                kv_donated=len(kv_params), kv_buffers=len(dstate.cache.k) * 2,
                insert_bytes=hlo_bytes(insert_text)["bytes"], insert_row=row,
                cost_analysis_bytes=float(cost.get("bytes accessed", float("nan"))))


def driver_run(cfg: Qwen3Config, args) -> dict:
    """Parts 2-4 of the module docstring on a concrete model with random weights."""
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    n_eos = max(1, cfg.vocab_size // 16)  # ~6 % stop chance per token with near-uniform random logits
    eos = tuple(range(cfg.vocab_size - n_eos, cfg.vocab_size))
    engine = Qwen3Engine(model, EngineConfig(
        max_concurrent_decodes=args.batch, max_prefill_length=args.prompt_len,
        max_decode_length=args.new_tokens, sampling=SamplingParams(temperature=1.0), eos_token_ids=eos))
    driver = RolloutDriver(engine, pad_token_id=0, steps_per_sync=args.steps_per_sync)
    compiles = CompileStats()  # every executable built, charged to the engine method in progress (its phase)
    steps = collections.Counter()
    calls: dict = collections.defaultdict(lambda: [0, 0.0])  # host calls per engine method: count, seconds
    for method in ("insert_sample", "step", "multi_step", "prefill_batch", "resize_decode_state"):
        inner = getattr(engine, method)

        def timed(*a, inner=inner, method=method, **kw):
            t0 = time.perf_counter()
            try:
                with compiles.phase(method):
                    return inner(*a, **kw)
            finally:
                calls[method][0] += 1
                calls[method][1] += time.perf_counter() - t0

        setattr(engine, method, timed)
    for method, n in (("step", 1), ("multi_step", None)):
        inner = getattr(engine, method)

        def counted(*a, inner=inner, n=n, **kw):
            steps["steps"] += n if n else (a[2] if len(a) > 2 else kw["num_steps"])
            return inner(*a, **kw)

        setattr(engine, method, counted)
    rng = np.random.default_rng(0)
    n_prompts = -(-args.rows // args.group)
    lengths = rng.integers(max(1, args.prompt_len // 2), args.prompt_len + 1, size=n_prompts)

    def prompts():
        return [rng.integers(1, cfg.vocab_size - n_eos, size=n).tolist() for n in lengths]

    driver.generate(prompts(), num_samples=args.group, max_new_tokens=args.new_tokens, seed=1)  # warm-up
    gets, wait = [0], [0.0]
    real_get = jax.device_get

    def counted_get(x):
        gets[0] += 1
        t0 = time.perf_counter()
        try:
            return real_get(x)
        finally:
            wait[0] += time.perf_counter() - t0

    steps.clear()
    calls.clear()
    compiles.start()
    t0 = time.perf_counter()
    with mock.patch.object(jax, "device_get", counted_get), jax.transfer_guard_device_to_host("disallow"):
        batch = driver.generate(prompts(), num_samples=args.group, max_new_tokens=args.new_tokens, seed=2)
    wall = time.perf_counter() - t0
    compiles.close()
    n_steps, tokens = steps["steps"], int(batch.response_lengths.sum())
    recompiles = collections.Counter(phase for _, phase, _, _ in compiles.executables)
    return dict(steps=n_steps, tokens=tokens, round_trips=gets[0], wall=wall, host=wall - wait[0],
                recompiles=dict(recompiles), lengths=batch.response_lengths, calls=dict(calls),
                refills=len(batch.response_lengths) - args.batch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="tiny (default) or qwen3-0.6b")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: float32 tiny, bfloat16 0.6b)")
    p.add_argument("--batch", type=int, default=None, help="decode slots (default 8 tiny, 256 qwen3-0.6b)")
    p.add_argument("--kv-length", type=int, default=None, help="cache positions of the analysed step "
                   "(default 64 tiny, 512 qwen3-0.6b)")
    p.add_argument("--sampling", default="t1", choices=("t1", "greedy", "top-p"),
                   help="step's sampling for the HLO: T=1 full vocabulary (the STAPO default), greedy, or "
                        "T=1 top_p=0.9 top_k=50")
    p.add_argument("--rows", type=int, default=None, help="responses sampled in parts 2-4 (default 3 x batch)")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=None, help="max new tokens (default 24 tiny, 128 0.6b)")
    p.add_argument("--steps-per-sync", type=int, default=8)
    p.add_argument("--hlo-only", action="store_true", help="part 1 only (no weights allocated)")
    p.add_argument("--max-ratio", type=float, default=1.5)
    p.add_argument("--top", type=int, default=8, help="contributors printed")
    p.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    args = p.parse_args(argv)
    big = args.preset == "qwen3-0.6b"
    args.dtype = args.dtype or ("bfloat16" if big else "float32")
    args.batch = args.batch or (256 if big else 16)
    args.kv_length = args.kv_length or (512 if big else 128)
    args.new_tokens = args.new_tokens or (128 if big else 32)
    args.rows = args.rows or 3 * args.batch
    sampling = {"t1": SamplingParams(temperature=1.0), "greedy": SamplingParams(greedy=True),
                "top-p": SamplingParams(temperature=1.0, top_p=0.9, top_k=50)}[args.sampling]
    cfg = model_config(args.preset, args.dtype)
    print(machine_line(), flush=True)
    print(f"decode step: {args.preset} {args.dtype}, {args.batch} slots x {args.kv_length} cache positions, "
          f"sampling {args.sampling}", flush=True)
    ok = True
    c = step_cost(cfg, args.batch, args.kv_length, sampling)
    print(f"HLO bytes per step {c['bytes'] / 1e6:.1f} MB (cost_analysis 'bytes accessed', uncorrected: "
          f"{c['cost_analysis_bytes'] / 1e6:.1f} MB) | weights {c['weights'] / 1e6:.1f} MB + live KV "
          f"{c['kv'] / 1e6:.1f} MB | compile {c['compile_s']:.1f} s", flush=True)
    print(f"HLO bytes ratio {c['device_ratio']:.3f} (goal <= {args.max_ratio}; {c['ratio']:.3f} with XLA:CPU's "
          f"rolled threefry loop counted per trip: {(c['bytes'] - c['device_bytes']) / 1e6:.2f} MB more)", flush=True)
    print(f"unbounded loops (a host round trip per iteration on GPU) {c['unbounded_loops']} | KV-cache buffers "
          f"donated (aliased to the outputs, updated in place) {c['kv_donated']}/{c['kv_buffers']}", flush=True)
    print(f"insert of one prefix row ({c['insert_row'] / 1e6:.3f} MB of KV): HLO bytes "
          f"{c['insert_bytes'] / 1e6:.3f} MB "
          f"(the whole batched prefix counted as read), against {2 * c['kv'] / 1e6:.1f} MB for a copy of the cache: "
          f"{'in place' if c['insert_bytes'] < c['kv'] else 'COPIED'}", flush=True)
    for kind, b in c["by_kind"].most_common(args.top):
        print(f"  {b / 1e6:10.1f} MB  {b / c['bytes'] * 100:5.1f} %  {kind}")
    ok &= c["device_ratio"] <= args.max_ratio and c["unbounded_loops"] == 0
    ok &= c["kv_donated"] == c["kv_buffers"] and c["insert_bytes"] < c["kv"]
    if not args.hlo_only:
        r = driver_run(cfg, args)
        per_step = r["round_trips"] / max(r["steps"], 1)
        print(f"host round trips per decode step {per_step:.4f} ({r['round_trips']} device_get over {r['steps']} "
              f"steps, steps_per_sync {args.steps_per_sync}; goal <= {1 / args.steps_per_sync:.4f}) | per "
              f"generated token {r['round_trips'] / max(r['tokens'], 1):.5f} ({r['tokens']} tokens)", flush=True)
        print(f"Python time per decode step: wall {r['wall'] / max(r['steps'], 1) * 1e3:.2f} ms, host (wall minus "
              f"device_get wait) {r['host'] / max(r['steps'], 1) * 1e3:.2f} ms", flush=True)
        print("host calls in the repeat run (count, mean ms per call incl. dispatch): " + ", ".join(
            f"{k} {c} x {t / c * 1e3:.2f} ms" for k, (c, t) in sorted(r["calls"].items())), flush=True)
        n = sum(r["recompiles"].values())
        print(f"recompiles on refill {n} {r['recompiles'] or ''} (repeat run: {r['refills']} refills, response "
              f"lengths {int(r['lengths'].min())}..{int(r['lengths'].max())})", flush=True)
        ok &= per_step <= 1 / args.steps_per_sync + 1e-9 and n == 0
    print(f"goals {'met' if ok else 'MISSED'}", flush=True)
    print(load_line("at end"))
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
