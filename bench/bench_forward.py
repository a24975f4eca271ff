"""Forward throughput of a Qwen3-0.6B-shaped model: ours (JAX/Flax, jitted) vs transformers' PyTorch
``Qwen3ForCausalLM`` on the same random weights, in one process.

The config is the real ``Qwen3-0.6B.json`` shipped in ``stapo_jax/assets/qwen3_configs`` (``models.presets.from_hf_config``);
weights are random (ours initialised, then copied into the HF model through ``models.hf.iter_hf_tensors``, the
exporter's tensor stream, so both sides compute the same function; the max |logit difference| is printed).
A "forward" is input ids [B, S] -> full logits [B, S, V] float32 on both sides (HF's default
``logits_to_keep=0``; ours ``model(...)`` then ``model.logits``), no padding, no KV cache.

Reported per batch size: tokens/s = B*S / median wall time of ``--repeats`` calls after one warm-up call,
the two sides interleaved (ours: ``block_until_ready``; torch: ``inference_mode``), the ratio ours/torch, and the compile time of our
jitted forward (``jit(...).lower(...).compile()``, seconds). The 1-minute load average is printed before and
after because the CPU may be shared.

    .venv/bin/python bench/bench_forward.py                  # seq 512, batch 1 and 4, fp32
    .venv/bin/python bench/bench_forward.py --batch-sizes 1 --seq 128 --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

from benchutil import interleaved, load_line, machine_line, median, summary, use_cli_allocator  # noqa: E402

from models.hf import iter_hf_tensors  # noqa: E402
from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402


def hf_copy(model: Qwen3, cfg) -> transformers.Qwen3ForCausalLM:
    """The HF model holding exactly our weights (built on the meta device, tensors assigned, head re-tied), in
    ``cfg.param_dtype`` (the tensors travel as float32 numpy, which holds bf16 values exactly)."""
    hf_cfg = transformers.Qwen3Config(**cfg.to_hf_dict())
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(hf_cfg)
    sd = {name: torch.from_numpy(arr) for name, arr in iter_hf_tensors(model, cfg, dtype="float32")}
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"HF state dict mismatch: missing={missing}, unexpected={unexpected}")
    # non-persistent buffers (RoPE inv_freq) are still on meta: rebuild them on CPU
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_cfg)
    return hf.to(getattr(torch, str(cfg.param_dtype))).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--config", default="Qwen3-0.6B", help="preset name or HF config.json path")
    args = ap.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    use_cli_allocator()
    print(machine_line())
    print(f"transformers {transformers.__version__}")
    cfg = from_hf_config(args.config, dtype=args.dtype, param_dtype=args.dtype)
    print(f"config {args.config}: D={cfg.hidden_size} F={cfg.intermediate_size} L={cfg.num_hidden_layers} "
          f"Nh={cfg.num_attention_heads} Nkv={cfg.num_key_value_heads} V={cfg.vocab_size} dtype={args.dtype}")
    t0 = time.perf_counter()
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    hf = hf_copy(model, cfg)
    print(f"init + copy into HF: {time.perf_counter() - t0:.1f}s")

    def fwd(state, ids, mask):
        m = nnx.merge(graphdef, state)
        hidden, _ = m(ids, mask)
        return m.logits(hidden)

    rows = []
    rng = np.random.default_rng(0)
    for b in batch_sizes:
        ids_np = rng.integers(0, cfg.vocab_size, size=(b, args.seq))
        ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.ones((b, args.seq), bool)
        t0 = time.perf_counter()
        compiled = jax.jit(fwd).lower(state, ids, mask).compile()
        compile_s = time.perf_counter() - t0
        ids_t, mask_t = torch.as_tensor(ids_np), torch.ones(b, args.seq, dtype=torch.long)

        def ours():
            return compiled(state, ids, mask).block_until_ready()

        def theirs():
            with torch.inference_mode():
                return hf(input_ids=ids_t, attention_mask=mask_t).logits

        diff = float(np.abs(np.asarray(ours(), np.float32) - theirs().float().numpy()).max())
        times = interleaved({"ours": ours, "torch": theirs}, args.repeats)
        t_ours, t_torch = median(times["ours"]), median(times["torch"])
        print(f"  ours {summary(times['ours'], 's')}, torch {summary(times['torch'], 's')}")
        tok = b * args.seq
        rows.append((b, tok / t_ours, tok / t_torch, compile_s, diff))
        print(f"batch {b} x seq {args.seq}: ours {tok / t_ours:8.1f} tok/s ({t_ours:.2f}s)  torch "
              f"{tok / t_torch:8.1f} tok/s ({t_torch:.2f}s)  ratio ours/torch {t_torch / t_ours:.2f}x  "
              f"compile {compile_s:.1f}s  max|dlogit| {diff:.2e}", flush=True)

    print("\n| batch | seq | ours tok/s | torch tok/s | ours/torch | compile s | max abs logit diff |")
    print("|---|---|---|---|---|---|---|")
    for b, o, t, c, d in rows:
        print(f"| {b} | {args.seq} | {o:.1f} | {t:.1f} | {o / t:.2f}x | {c:.1f} | {d:.1e} |")
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
