"""Rollout decode throughput: our JetStream engine + in-process driver vs transformers ``generate`` (PyTorch
CPU, KV cache) on the same weights, in one process; plus the weight-sync time of the driver.

Workload per model: B=32 prompts of 16 random tokens, 128 new tokens each, greedy, no EOS (both sides emit
exactly B*128 tokens), in ``--dtype`` (float32 by default; bfloat16: weights, activations and KV cache in bf16
on both sides). Throughput = generated tokens / median wall time of full ``generate`` calls (5 for
tiny, 3 for 0.6b; ours and HF interleaved, spread [min..max] printed), after a warm-up call (ours: one
full-length call, which compiles every KV-cache length; HF: 6-token runs). Ours includes prefill,
per-token full-vocabulary log-probs and the host loop of continuous batching; HF's ``generate`` computes no
log-probs. The greedy tokens of both sides are compared (fraction of identical rows is printed: random
weights can have near-ties, so it need not be 1.0 on the big model). Ours is timed with the driver's
``steps_per_sync`` = 1 (default: host round trip and refill after every step) and, for tiny, 8 (eight
steps per jitted call). ``--kernel-layouts in_out,out_in`` times the engine's two decode kernel layouts
(``EngineConfig.kernel_layout``: [in, out] as the trainer, or [out, in], the CPU default) side by side;
``--kv-cache-buckets on,off`` the KV cache kept at the smallest length that holds the active slots (default) and
the full-length cache.

Models: ``tiny`` (2 layers, D=64, V=1024) and ``0.6b`` (the real Qwen3-0.6B config from
``stapo_jax/assets/qwen3_configs``, random weights), both in ``--dtype``. Weights go into the HF model through the
exporter's tensor stream (``bench_forward.hf_copy`` over ``models.hf.iter_hf_tensors``).

torch runs with the faster of 1 thread and all cores (measured on a 6-token run first): on a shared, busy
host OpenMP spin-waiting can make the multi-threaded run many times slower.

Weight sync: ``RolloutDriver.sync_weights`` with (a) device-resident parameters of the same shardings (the
trainer's case: validation plus one device copy of the layer weights into the engine's per-layer buffers, which
``set_params`` donates and reuses) and (b) host numpy parameters (host->device placement plus that copy); median
of 3. bench/bench_weight_sync.py compares that copy with the former one into fresh buffers.

    .venv/bin/python bench/bench_rollout.py                      # tiny and 0.6b (several minutes on 2 cores)
    .venv/bin/python bench/bench_rollout.py --models tiny        # quick
    python bench/bench_rollout.py --models 0.6b --torch-device cuda --dtype bfloat16   # GPU: HF generate on CUDA
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

from bench_forward import hf_copy  # noqa: E402
from benchutil import (interleaved, load_line, machine_line, median, pick_torch_threads, ratio,  # noqa: E402
                       summary, use_cli_allocator)
from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from models.qwen3_config import Qwen3Config  # noqa: E402
from stapo_jax.assets import qwen3_config_dir  # noqa: E402
from stapo_jax.rollout.driver import RolloutDriver  # noqa: E402
from stapo_jax.rollout.engine import EngineConfig, Qwen3Engine  # noqa: E402
from stapo_jax.rollout.sampling import SamplingParams  # noqa: E402

CONFIG_06B = qwen3_config_dir() / "Qwen3-0.6B.json"


def model_config(name: str, dtype: str = "float32") -> Qwen3Config:
    if name == "tiny":
        return Qwen3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=None,
                           bos_token_id=None, pad_token_id=0, tie_word_embeddings=True, dtype=dtype,
                           param_dtype=dtype)
    if name == "0.6b":
        import dataclasses

        return dataclasses.replace(from_hf_config(str(CONFIG_06B)), dtype=dtype, param_dtype=dtype,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=0)
    raise SystemExit(f"unknown model {name!r}: expected tiny or 0.6b")


def bench_one(name: str, batch: int, new_tokens: int, prompt_len: int, repeats: int,
              steps_per_sync: tuple[int, ...], torch_device: str = "cpu", kernel_layouts: tuple[str, ...] = ("auto",),
              kv_cache_buckets: tuple[bool, ...] = (True,), dtype: str = "float32") -> dict:
    cfg = model_config(name, dtype)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    hf = hf_copy(model, cfg).to(torch_device)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, size=(batch, prompt_len)).astype(np.int32)

    engines = [Qwen3Engine(model, EngineConfig(
        max_concurrent_decodes=batch, max_prefill_length=prompt_len, max_decode_length=new_tokens,
        sampling=SamplingParams(greedy=True), eos_token_ids=(), kernel_layout=layout, kv_cache_buckets=buckets))
        for layout in kernel_layouts for buckets in kv_cache_buckets]
    drivers = {f"steps_per_sync={k}, kernels {e.kernel_layout}, kv_cache_buckets={e.config.kv_cache_buckets}":
               RolloutDriver(e, pad_token_id=0, steps_per_sync=k) for e in engines for k in steps_per_sync}
    driver = next(iter(drivers.values()))
    t0 = time.perf_counter()
    for d in drivers.values():  # compiles prefill/insert/step (shapes do not depend on N) at every cache length
        d.generate(list(prompts), max_new_tokens=new_tokens)
    compile_s = time.perf_counter() - t0
    print(f"[{name}] compile + warm-up of ours: {compile_s:.1f} s", flush=True)  # before the timing: a cut run keeps it

    ids = torch.from_numpy(prompts.astype(np.int64)).to(torch_device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, use_cache=True, eos_token_id=None,
              pad_token_id=0, top_k=None, top_p=None, temperature=None)
    last = {}

    def ours_side(k, d):
        def run():
            last["ours"] = d.generate(list(prompts), max_new_tokens=new_tokens)
            assert last["ours"].response_lengths.min() == new_tokens

        return run

    def hf_side():
        last["hf"] = hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw).cpu()  # syncs

    with torch.inference_mode():
        torch_threads = pick_torch_threads(
            lambda: hf.generate(ids, max_new_tokens=6, min_new_tokens=6, **kw), repeats=1)
        sides = {f"ours {k}": ours_side(k, d) for k, d in drivers.items()}
        sides["HF generate"] = hf_side
        times = interleaved(sides, repeats, warmup=0)  # ours compiled above; HF warmed by the thread probe
    ours, out = last["ours"], last["hf"]
    hf_times = times.pop("HF generate")
    hf_s = median(hf_times)
    hf_tokens = out[:, prompt_len:].numpy()
    same_rows = float(np.mean(np.all(hf_tokens == ours.responses, axis=1)))
    n = batch * new_tokens

    state = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(1)))[1]
    device_s = median(driver.sync_weights(state) for _ in range(3))
    host_state = jax.tree.map(np.asarray, state)
    host_s = median(driver.sync_weights(host_state) for _ in range(3))
    mib = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    return dict(model=name, repeats=repeats, torch_threads=torch_threads, times=times, hf_times=hf_times,
                hf_tok_s=n / hf_s,
                n=n, hf_s=hf_s, compile_s=compile_s, same_rows=same_rows, sync_device_s=device_s, sync_host_s=host_s,
                param_mib=mib)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,0.6b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per side, interleaved, median reported (default: 5 for tiny, 3 for 0.6b)")
    p.add_argument("--steps-per-sync", default=None,
                   help="driver steps_per_sync values to time, comma-separated (default: 1,8 for tiny, 1 for 0.6b)")
    p.add_argument("--torch-device", default="cpu", help="device of the HF side (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="weights and compute, both sides")
    p.add_argument("--kv-cache-buckets", default="on",
                   help="EngineConfig.kv_cache_buckets values to time side by side: on, off or on,off (on: the KV "
                        "cache is kept at the smallest bucket holding the active slots)")
    p.add_argument("--kernel-layouts", default="auto",
                   help="EngineConfig.kernel_layout values to time side by side, comma-separated (auto, in_out, "
                        "out_in; auto = out_in on CPU)")
    args = p.parse_args(argv)
    use_cli_allocator()
    print(machine_line(), flush=True)
    print(f"batch {args.batch} x {args.new_tokens} new tokens, prompts of {args.prompt_len} tokens, greedy, {args.dtype}")
    for name in args.models.split(","):
        name = name.strip()
        repeats = args.repeats or (5 if name == "tiny" else 3)
        if repeats < 3:
            raise SystemExit(f"--repeats must be >= 3 for a median with spread (got {repeats})")
        k = tuple(int(x) for x in (args.steps_per_sync or ("1,8" if name == "tiny" else "1")).split(","))
        layouts = tuple(x.strip() for x in args.kernel_layouts.split(","))
        buckets = tuple({"on": True, "off": False}[x.strip()] for x in args.kv_cache_buckets.split(","))
        r = bench_one(name, args.batch, args.new_tokens, args.prompt_len, repeats, k, args.torch_device, layouts,
                      buckets, args.dtype)
        print(f"[{r['model']}] HF generate {r['hf_tok_s']:.1f} tok/s ({summary(r['hf_times'], 's')}, "
              f"{args.torch_device}, {r['torch_threads']} torch thread(s), the faster of 1 and all)", flush=True)
        for label, ts in r["times"].items():
            print(f"[{r['model']}] {label}: {r['n'] / median(ts):.1f} tok/s ({summary(ts, 's')}) | ratio ours/HF = "
                  f"{ratio(r['hf_times'], ts)}x (throughput, median [per-round min..max]) | identical greedy rows "
                  f"{r['same_rows']:.2f}", flush=True)
        print(f"[{r['model']}] weight sync ({r['param_mib']:.0f} MiB): device-resident {r['sync_device_s'] * 1e3:.1f} ms,"
              f" from host numpy {r['sync_host_s'] * 1e3:.1f} ms (medians of 3)", flush=True)
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
