"""Weight sync into the rollout engine, and the sampler's draw + log-prob: the old path vs the new, in one run.

Sections (every one interleaved old/new, >= 3 repeats, median [min..max] and the ratio old/new):

1. **Weight sync** of device-resident parameters (the trainer's case; same shardings, so ``device_put`` is a
   no-op) into a :class:`~stapo_jax.rollout.engine.Qwen3Engine`, alternating two different parameter states:
   * old (re-created here): ``engine.place_params``, i.e. the layer weights copied into *fresh* buffers while
     the previous ones are still alive, which is what ``set_params`` did before this bench was written
     (``self._params = self.place_params(params)``);
   * new: ``engine.set_params``, the same copy written layer by layer into the engine's previous per-layer
     buffers (donated);
   * new out_in: ``set_params`` of a second engine with ``EngineConfig(kernel_layout="out_in")`` (the CPU
     default of ``"auto"``), whose copy transposes every linear kernel to [out, in] (faster decode steps,
     bench/bench_rollout.py); the first two engines use ``"in_out"``.
   The first call of each side after the engine started is printed apart (old: fresh pages to fault in;
   new: compiling its one-layer copy).
   Printed beside them: validation + ``device_put`` alone, and a numpy copy of the same bytes into
   already-touched memory (the copy's floor on this machine).
2. **Sampler** (``sample_tokens`` at temperature > 0, B x V logits, jitted): old (re-created here:
   ``jax.random.categorical`` over the truncated scaled logits, then ``logits_to_log_probs`` from the raw
   logits) vs new (one shared scaled copy, Gumbel-max draw, ``scaled_log_probs`` with the row maximum reused
   when truncation has it); the tokens of both are checked equal. When the setting truncates, a third side,
   "before" (``sort_sample_tokens``), is the new sampler with the sort-based truncation it had before the
   bisection (``tests/sampling_reference.py``, ``jax.lax.top_k`` / full-vocabulary sort), with the ratio
   before/new and whether its tokens equal the new ones.
3. **Decode** (``--decode-tokens`` > 0): ``RolloutDriver.generate`` at temperature 1.0 with the old sampler
   (patched into ``decode_fns`` for that side only) and the new one; tokens checked equal.

    PYTHONPATH=. .venv/bin/python bench/bench_weight_sync.py                 # 0.6b (a few minutes on 2 cores)
    PYTHONPATH=. .venv/bin/python bench/bench_weight_sync.py --model tiny --decode-tokens 8
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from bench_rollout import model_config  # noqa: E402
from benchutil import interleaved, load_line, machine_line, ratio, summary, use_cli_allocator  # noqa: E402
from models.decode import LAYERS_KEY  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from models.sharding import param_shardings  # noqa: E402
from sampling_reference import sort_truncate_logits  # noqa: E402
from stapo_jax.algo.logprobs import logits_to_log_probs, scaled_log_probs  # noqa: E402
from stapo_jax.rollout import decode_fns  # noqa: E402
from stapo_jax.rollout.driver import RolloutDriver  # noqa: E402
from stapo_jax.rollout.engine import EngineConfig, Qwen3Engine  # noqa: E402
from stapo_jax.rollout.sampling import SamplingParams, gumbel_noise, sample_tokens, truncate_logits  # noqa: E402


def old_sample_tokens(logits, keys, params: SamplingParams):
    """The sampler before the fusion (re-created for the comparison): categorical draw, then the trainer's
    log-prob from the raw logits."""
    logits = logits.astype(jnp.float32)
    scaled = truncate_logits(logits / params.temperature, params.top_k, params.top_p)
    tokens = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return tokens, logits_to_log_probs(logits, tokens, params.temperature)


def sort_sample_tokens(logits, keys, params: SamplingParams):
    """The fused sampler with the sort-based truncation of before the bisection (re-created): the "before"
    side of the truncation change."""
    z = logits.astype(jnp.float32) / params.temperature
    truncated = sort_truncate_logits(z, params.top_k, params.top_p)
    tokens = jnp.argmax(gumbel_noise(keys, z.shape[-1]) + truncated, axis=-1).astype(jnp.int32)
    return tokens, scaled_log_probs(z, tokens, jnp.max(z, axis=-1))


def bench_sync(engine: Qwen3Engine, transposed: Qwen3Engine, states: list, repeats: int) -> None:
    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(states[0][LAYERS_KEY]))
    shardings = param_shardings(states[0], engine.mesh)
    count = {"old": 0, "new": 0, "out_in": 0}
    held = {"old": engine.place_params(states[1])}

    def old():  # fresh buffers; the previous result stays alive until the new one exists (old set_params)
        held["old"] = engine.place_params(states[count["old"] % 2])
        count["old"] += 1

    def new():
        engine.set_params(states[count["new"] % 2])
        count["new"] += 1

    def out_in():
        transposed.set_params(states[count["out_in"] % 2])
        count["out_in"] += 1

    def put():
        jax.block_until_ready(jax.device_put(states[0], shardings))

    src = np.ones(layer_bytes // 4, np.float32)
    dst = np.zeros_like(src)
    first = {}
    for k, f in (("new", new), ("old", old), ("out_in", out_in)):  # the first sync after the engine started
        t0 = time.perf_counter()
        f()
        first[k] = time.perf_counter() - t0
    sides = {"old": old, "new": new, "out_in": out_in, "put": put, "memcpy": lambda: np.copyto(dst, src)}
    times = interleaved(sides, repeats, warmup=0)
    print(f"[sync] layer weights {layer_bytes / 2**20:.0f} MiB, all parameters "
          f"{sum(x.nbytes for x in jax.tree.leaves(states[0])) / 2**20:.0f} MiB, device-resident", flush=True)
    print(f"[sync] old: place_params into fresh buffers (re-created)  {summary(times['old'], 's')}")
    print(f"[sync] new: set_params into the donated previous buffers   {summary(times['new'], 's')}")
    print(f"[sync] new out_in: set_params transposing the kernels     {summary(times['out_in'], 's')} "
          f"(ratio new/new out_in = {ratio(times['new'], times['out_in'])}x)")
    print(f"[sync] first call after the engine started (not in the medians): old {first['old']:.3f} s, "
          f"new {first['new']:.3f} s, new out_in {first['out_in']:.3f} s (includes compiling the per-layer copy)")
    print(f"[sync] ratio old/new = {ratio(times['old'], times['new'])}x (median [per-round min..max])")
    print(f"[sync] of which validation + device_put (no-op placement): {summary(times['put'], 'ms')}; "
          f"numpy copy of the layer bytes into touched memory: {summary(times['memcpy'], 's')}", flush=True)
    a, b = engine.load_params(), held["old"]  # both were last given states[repeats % 2]
    same = all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    print(f"[sync] old and new parameters identical: {same}", flush=True)


def bench_sampler(batch: int, vocab: int, repeats: int) -> None:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(batch, vocab)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(0), batch)
    for params in (SamplingParams(1.0), SamplingParams(0.6, top_k=50), SamplingParams(0.7, top_p=0.9),
                   SamplingParams(0.7, top_k=50, top_p=0.95)):
        fns = {"old": jax.jit(old_sample_tokens, static_argnums=2), "new": jax.jit(sample_tokens, static_argnums=2)}
        if params.truncates:
            fns["before"] = jax.jit(sort_sample_tokens, static_argnums=2)
        out = {}

        def side(k):
            def run():
                out[k] = jax.block_until_ready(fns[k](logits, keys, params))
            return run

        times = interleaved({k: side(k) for k in fns}, repeats)
        same = bool(np.array_equal(np.asarray(out["old"][0]), np.asarray(out["new"][0])))
        dlp = float(np.max(np.abs(np.asarray(out["old"][1]) - np.asarray(out["new"][1]))))
        print(f"[sampler B={batch} V={vocab} T={params.temperature} top_k={params.top_k} top_p={params.top_p}] "
              f"old {summary(times['old'])} | new {summary(times['new'])} | ratio old/new "
              f"{ratio(times['old'], times['new'])}x | same tokens {same}, max |d log_prob| {dlp:.1e}", flush=True)
        if "before" in fns:
            same = bool(np.array_equal(np.asarray(out["before"][0]), np.asarray(out["new"][0])))
            print(f"[sampler B={batch} V={vocab} T={params.temperature} top_k={params.top_k} top_p={params.top_p}] "
                  f"truncation: before (sort-based) {summary(times['before'])} | new (bisection) "
                  f"{summary(times['new'])} | ratio before/new {ratio(times['before'], times['new'])}x | "
                  f"same tokens {same}", flush=True)


def bench_decode(engine: Qwen3Engine, batch: int, new_tokens: int, repeats: int) -> None:
    v = engine.model_config.vocab_size
    prompts = list(np.random.default_rng(1).integers(1, v, size=(batch, 16)).astype(np.int32))
    drv = RolloutDriver(engine, pad_token_id=0, steps_per_sync=new_tokens)
    # top_k >= V truncates nothing: two distinct static settings give each side its own compiled step
    sp = {"old": SamplingParams(1.0, top_k=v), "new": SamplingParams(1.0, top_k=v + 1)}
    out = {}

    def side(k):
        def run():
            if k == "old":
                decode_fns.sample_tokens = old_sample_tokens
            try:
                out[k] = drv.generate(prompts, max_new_tokens=new_tokens, sampling=sp[k], seed=3)
            finally:
                decode_fns.sample_tokens = sample_tokens
        return run

    times = interleaved({k: side(k) for k in sp}, repeats)
    n = batch * new_tokens
    same = bool(np.array_equal(out["old"].responses, out["new"].responses))
    print(f"[decode B={batch} x {new_tokens} new tokens, T=1.0, prefill included] old sampler "
          f"{n / np.median(times['old']):.1f} tok/s ({summary(times['old'], 's')}) | new "
          f"{n / np.median(times['new']):.1f} tok/s ({summary(times['new'], 's')}) | ratio of throughput new/old "
          f"{ratio(times['old'], times['new'])}x | same tokens {same}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="0.6b", help="tiny or 0.6b (fp32, random weights)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds per section (>= 3)")
    p.add_argument("--sampler-batch", type=int, default=32)
    p.add_argument("--sampler-vocab", type=int, default=151936)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=16, help="0 skips the decode section")
    p.add_argument("--sections", default="sync,sampler,decode")
    args = p.parse_args(argv)
    if args.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3 for a median with spread (got {args.repeats})")
    sections = set(args.sections.split(","))
    use_cli_allocator()
    print(machine_line(), flush=True)
    if "sampler" in sections:
        bench_sampler(args.sampler_batch, args.sampler_vocab, args.repeats)
    if sections & {"sync", "decode"}:
        cfg = model_config(args.model)
        model = Qwen3(cfg, rngs=nnx.Rngs(0))
        engine_config = EngineConfig(max_concurrent_decodes=args.decode_batch, max_prefill_length=16,
                                     max_decode_length=max(args.decode_tokens, 1), eos_token_ids=(),
                                     kernel_layout="in_out")
        engine = Qwen3Engine(model, engine_config)
        transposed = (Qwen3Engine(model, dataclasses.replace(engine_config, kernel_layout="out_in"))
                      if "sync" in sections else None)
        shardings = param_shardings(nnx.split(model)[1], engine.mesh)
        states = [jax.block_until_ready(jax.device_put(nnx.split(model)[1], shardings)),
                  jax.block_until_ready(jax.device_put(nnx.split(Qwen3(cfg, rngs=nnx.Rngs(1)))[1], shardings))]
        del model
        print(f"model {args.model}: {dataclasses.asdict(cfg)['num_hidden_layers']} layers, fp32", flush=True)
        if "sync" in sections:
            bench_sync(engine, transposed, states, args.repeats)
        if "decode" in sections and args.decode_tokens > 0:
            bench_decode(engine, args.decode_batch, args.decode_tokens, args.repeats)
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
