"""One full policy update (forward + backward + optimizer) per second: ours (the trainer's jitted
``make_train_step`` with the STAPO recipe and AdamW, Flax Qwen3) vs transformers' PyTorch ``Qwen3ForCausalLM``
with a token-level policy-gradient loss and ``torch.optim.AdamW``, same weights and shapes, one process; fp32 on
the CPU by default, ``--device cuda --dtype bfloat16`` on a GPU (``bench/gpu_check.sh``).

Precision: ``--dtype float32`` runs both sides in fp32. ``--dtype bfloat16`` is mixed precision on both sides,
fp32 master weights and optimizer state with bf16 matmuls: ours ``Qwen3Config(dtype=bfloat16,
param_dtype=float32)``, torch the fp32 model under ``torch.autocast(dtype=torch.bfloat16)`` (the logits are cast
to fp32 before the log-softmax on both sides). ``--device`` places the torch side (``cpu`` or ``cuda``); ours runs
on JAX's default backend (``JAX_PLATFORMS``).

Sides (each call is one optimizer step on the same mini-batch; both models keep training across calls):

* ``ours``: ``stapo_jax.train.train_step.make_train_step(get_recipe("stapo"), make_optimizer(...),
  donate=True)`` as the trainer builds it (``seq_chunk=512``, ``vocab_chunk=None``, remat ``--remat``, default
  ``dots_no_batch`` as ``model.remat``); the batch carries ``old_log_probs`` / ``old_entropy`` from
  ``make_log_prob_fn`` (+ noise), as the trainer's old-log-prob pass gives them. S2T runs (statistics, mask,
  diagnostics); ``--tau-p`` (default 1e-9) makes it mask ~0 tokens as in a real run (the masked fraction is
  printed), so both sides optimise the same loss.
* ``torch``: ``hf(input_ids, attention_mask, logits_to_keep=R + 1)`` (logits only over the response
  positions), ``bench_loss.torch_pg_loss`` (``log_softmax`` + ``gather``, verl dual-clip PPO surrogate,
  token-mean over the response mask), ``backward``, ``clip_grad_norm_``, ``AdamW.step``. ``--torch-entropy``
  adds a side that also computes the entropy (no gradient), as ours does. Torch uses no activation
  checkpointing.

Both optimizers: lr 1e-6, betas (0.9, 0.999), eps 1e-8, weight decay 0.1, global-norm clip 1.0 (the trainer's
``actor.optim`` defaults; no warm-up on either side). Correctness, untimed: the loss of step 0 (same weights,
same batch) is printed for both sides and asserted close (fp32: rtol 1e-3; bf16, where the two
frameworks round differently: within 10 % of max(1, |loss|), a check for gross errors only).

Warm-up: step 0 and then one more untimed round of every side. Our second step still first-touched its
temporaries (547k page faults: 7.7 CPU-seconds in the kernel, +3.8 s of wall time at 28 layers on a Zen 3),
most likely because torch's step 0, in the same heap, had reused the memory ours freed; from the third step on
neither side faulted (``resource.getrusage`` around each call).

Reported: the machine and its load (before/after), per side the median [min..max] seconds of ``--repeats``
interleaved steps, tokens/s = B·(P+R) / median, the ratio ours/torch in tokens/s (> 1: ours faster; per-round
spread) with the ratio of process CPU seconds (all threads), and the fraction of the measured matmul peak (an
``--peak-n``-square matmul in each framework in ``--dtype``, median of 3) reached by the model FLOPs
6·(N·B·(P+R) + D·V·B·R): N = the decoder's matmul weights (no embedding, no norms), the tied head counted
over the R response positions only (both sides compute logits only there); attention scores not counted.

    .venv/bin/python bench/bench_update.py                       # 2 layers, Qwen3-0.6B widths, V=151,936, B=2, P=R=64
    .venv/bin/python bench/bench_update.py --preset qwen3-0.6b --P 256 --R 256   # the full 28-layer shape
    .venv/bin/python bench/bench_update.py --vocab 8192 --repeats 3             # quick
    python3 bench/bench_update.py --preset qwen3-0.6b --B 8 --P 512 --R 512 --device cuda --dtype bfloat16 \
        --peak-n 8192 --chip-peak 989                                            # one H200, bf16
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from bench_forward import hf_copy  # noqa: E402
from bench_loss import torch_pg_loss  # noqa: E402
from benchutil import (interleaved, load_line, machine_line, median, pick_torch_threads,  # noqa: E402
                       report_throughput, scan_unroll_arg, use_cli_allocator)

from models.layer_scan import resolve_scan_unroll  # noqa: E402
from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from stapo_jax.config.recipes import get_recipe  # noqa: E402
from stapo_jax.train.optim import make_optimizer  # noqa: E402
from stapo_jax.train.train_step import Batch, TrainState, make_log_prob_fn, make_train_step  # noqa: E402

OPTIM = dict(lr=1e-6, weight_decay=0.1, clip_grad=1.0, betas=(0.9, 0.999), eps=1e-8)  # actor.optim defaults


def matmul_peak(n: int, repeats: int = 3, dtype: str = "float32", device: str = "cpu") -> tuple[float, float]:
    """Measured matmul throughput ``(jax, torch)`` in GFLOP/s: median seconds of an ``[n, n] @ [n, n]`` in
    ``dtype`` in each framework (JAX on its default backend, torch on ``device``; interleaved, one warm-up; on an
    accelerator 10 products per timed call, then a sync), 2·n³ FLOPs per product."""
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    per_call = 1 if device == "cpu" else 10
    ja, jb = (jnp.asarray(x, dtype=dtype) for x in (a, b))
    ta, tb = (torch.from_numpy(x).to(device=device, dtype=getattr(torch, dtype)) for x in (a, b))
    mm = jax.jit(jnp.matmul)

    def jax_side():
        for _ in range(per_call):
            out = mm(ja, jb)
        out.block_until_ready()

    def torch_side():
        for _ in range(per_call):
            torch.mm(ta, tb)
        if device != "cpu":
            torch.cuda.synchronize()

    times = interleaved({"jax": jax_side, "torch": torch_side}, repeats)
    return tuple(2 * n ** 3 * per_call / median(times[k]) / 1e9 for k in ("jax", "torch"))


def make_batch(cfg, b: int, p: int, r: int, seed: int = 0) -> dict:
    """Numpy mini-batch: prompt of ``p`` tokens (no padding), response of ``r`` columns with lengths uniform in
    [r/2, r] (right padding, id 0), GRPO-like advantages ``[B]`` ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, r // 2), r + 1, b)
    resp = (np.arange(r)[None] < lengths[:, None])
    ids = rng.integers(1, cfg.vocab_size, (b, p + r)).astype(np.int32)
    ids[:, p:][~resp] = 0
    att = np.concatenate([np.ones((b, p), bool), resp], axis=1)
    return dict(input_ids=ids, attention_mask=att, response_mask=resp,
                advantages=rng.standard_normal(b).astype(np.float32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", choices=("small", "qwen3-0.6b"),
                    help="small: Qwen3-0.6B widths with 2 layers; qwen3-0.6b: all 28 layers")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the real 151,936)")
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--P", type=int, default=64, help="prompt tokens")
    ap.add_argument("--R", type=int, default=64, help="response columns")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--remat", default="dots_no_batch", choices=("none", "full", "dots", "dots_no_batch"))
    ap.add_argument("--scan-unroll", default="auto",
                    help="ours: decoder layers per layer-scan iteration (model.scan_unroll; auto = its default)")
    ap.add_argument("--tau-p", type=float, default=1e-9, help="S2T tau_p (paper 0.002 masks ~a third of a "
                    "random model's tokens; then the losses differ and the step-0 check is skipped)")
    ap.add_argument("--torch-entropy", action="store_true", help="add a torch side that also computes entropy")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch intra-op threads (0: the faster of 1 and all cores, one step each after step 0)")
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--device", default="cpu", help="device of the torch side (cpu, cuda); ours: JAX's backend")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="matmul precision of both sides (bfloat16: fp32 master weights, bf16 compute)")
    ap.add_argument("--chip-peak", type=float, default=0.0,
                    help="the chip's peak in --dtype, TFLOP/s (0: not printed), for the MFU line")
    a = ap.parse_args(argv)
    if a.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3 for a median with spread (got {a.repeats})")
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    use_cli_allocator()
    print(machine_line(), flush=True)
    print(f"transformers {transformers.__version__}")

    base = from_hf_config("Qwen3-0.6B", dtype=a.dtype, param_dtype="float32")
    layers = a.layers or (2 if a.preset == "small" else base.num_hidden_layers)
    cfg = dataclasses.replace(base, num_hidden_layers=layers, vocab_size=a.vocab or base.vocab_size, remat=a.remat,
                              scan_unroll=resolve_scan_unroll(scan_unroll_arg(a.scan_unroll)))
    b, p, r, t = a.B, a.P, a.R, a.P + a.R
    d, f, nh, nkv, hd, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    n_dec = layers * (d * (nh + 2 * nkv) * hd + nh * hd * d + 3 * d * f)
    model_flops = 6 * (n_dec * b * t + d * v * b * r)
    print(f"shape: Qwen3-0.6B widths D={d} F={f} Nh={nh} Nkv={nkv} H={hd}, L={layers}, V={v}, tied head; "
          f"B={b} P={p} R={r} (T={t}); {a.dtype} (fp32 master weights); torch on {a.device}; remat {a.remat}, "
          f"scan_unroll {cfg.scan_unroll}; "
          f"decoder matmul weights N={n_dec / 1e6:.1f} M; "
          f"model FLOPs/update 6·(N·B·T + D·V·B·R) = {model_flops / 1e9:.1f} GFLOP", flush=True)

    t0 = time.perf_counter()
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    hf = hf_copy(model, cfg).to(a.device).train()
    with torch.no_grad():  # own, writable, trainable copies (the loaded tensors may share host numpy buffers)
        for prm in hf.parameters():
            prm.data = prm.data.clone()
            prm.requires_grad_(True)
    if cfg.tie_word_embeddings:  # one Parameter for embedding and head, as HF's own tied model has
        hf.lm_head.weight = hf.model.embed_tokens.weight
    recipe = get_recipe("stapo", s2t={"tau_p": a.tau_p})
    optimizer = make_optimizer(OPTIM["lr"], weight_decay=OPTIM["weight_decay"], clip_grad=OPTIM["clip_grad"],
                               betas=OPTIM["betas"], eps=OPTIM["eps"])
    state = TrainState.create(model, optimizer)
    del model
    print(f"init + copy into HF: {time.perf_counter() - t0:.1f}s", flush=True)

    # the batch; old log-probs / entropy from our old-log-prob pass (+ noise, so the ratio is not 1)
    nb = make_batch(cfg, b, p, r)
    lp_fn = jax.jit(make_log_prob_fn(), static_argnums=(1, 4))
    old_lp, old_ent = lp_fn(state.params, state.graphdef, jnp.asarray(nb["input_ids"]),
                            jnp.asarray(nb["attention_mask"]), r)
    rng = np.random.default_rng(2)
    old_lp = (np.asarray(old_lp) + 0.05 * rng.standard_normal((b, r))).astype(np.float32)
    batch = Batch(input_ids=jnp.asarray(nb["input_ids"]), attention_mask=jnp.asarray(nb["attention_mask"]),
                  response_mask=jnp.asarray(nb["response_mask"]), advantages=jnp.asarray(nb["advantages"]),
                  old_log_probs=jnp.asarray(old_lp), old_entropy=old_ent)
    step = make_train_step(recipe, optimizer, vocab_size=v, donate=True)
    t0 = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0

    dev = a.device
    t_ids, t_att = (torch.from_numpy(nb[k]).long().to(dev) for k in ("input_ids", "attention_mask"))
    t_old, t_adv = torch.from_numpy(old_lp).to(dev), torch.from_numpy(nb["advantages"]).to(dev)
    t_resp, t_tgt = torch.from_numpy(nb["response_mask"]).float().to(dev), t_ids[:, p:]
    autocast = (torch.autocast(device_type=dev, dtype=torch.bfloat16) if a.dtype == "bfloat16"
                else contextlib.nullcontext())
    t_opt = torch.optim.AdamW(hf.parameters(), lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"],
                              weight_decay=OPTIM["weight_decay"])
    holder = {"state": state}

    def ours():
        holder["state"], m = compiled(holder["state"], batch)
        return jax.block_until_ready(m)

    def torch_step(with_entropy: bool):
        def run():
            with autocast:
                z = hf(input_ids=t_ids, attention_mask=t_att, logits_to_keep=r + 1).logits[:, :-1].float()
            loss = torch_pg_loss(z, t_tgt, t_old, t_adv, t_resp, recipe.loss, with_entropy)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), OPTIM["clip_grad"])
            t_opt.step()
            t_opt.zero_grad(set_to_none=True)
            return loss.item()

        return run

    sides = {"ours": ours, "torch": torch_step(False)}
    if a.torch_entropy:
        sides["torch + entropy"] = torch_step(True)

    # step 0 (the warm-up of every side): same weights, same batch -> same loss
    m0 = ours()
    losses = {"ours": float(m0["loss"])}
    losses.update({k: fn() for k, fn in sides.items() if k != "ours"})
    if not a.torch_threads and dev == "cpu":  # OpenMP spin-waiting: all-core torch can be much slower on a busy host
        pick_torch_threads(sides["torch"], repeats=1)
    masked = float(m0["s2t/masked_frac"])
    print(f"ours: compile {compile_s:.1f}s; step-0 loss ours {losses['ours']:.6f} vs torch {losses['torch']:.6f} "
          f"(|diff| {abs(losses['ours'] - losses['torch']):.1e}); S2T tau_p={a.tau_p:g} masked "
          f"{masked * 100:.3f} % of tokens; grad_norm {float(m0['grad_norm']):.4f}; torch threads "
          f"{torch.get_num_threads()}{'' if a.torch_threads else ' (the faster of 1 and all cores)'}", flush=True)
    diff, scale = abs(losses["ours"] - losses["torch"]), max(1.0, abs(losses["torch"]))
    close = (diff <= 0.1 * scale if a.dtype == "bfloat16"
             else np.isclose(losses["ours"], losses["torch"], rtol=1e-3, atol=1e-5))
    if masked == 0.0 and not close:
        raise SystemExit(f"step-0 losses differ: {losses}")

    cpu: dict[str, list[float]] = {}
    times = interleaved(sides, a.repeats, warmup=1, cpu=cpu)  # warm-up: see the module docstring
    peak_jax, peak_torch = matmul_peak(a.peak_n, dtype=a.dtype, device=dev)
    print(f"measured {a.dtype} matmul peak ({a.peak_n}^3, median of 3): jax {peak_jax:.1f} GFLOP/s, torch "
          f"{peak_torch:.1f} GFLOP/s")
    report_throughput(times, what="update", tokens=b * t, flops=model_flops,
                      peaks={k: peak_jax if k == "ours" else peak_torch for k in times}, cpu=cpu)
    if a.chip_peak:
        mfu = ", ".join(f"{k} {model_flops / median(ts) / 1e12 / a.chip_peak * 100:.1f} %" for k, ts in times.items())
        print(f"MFU against the chip's {a.dtype} peak of {a.chip_peak:g} TFLOP/s (model FLOPs as above): {mfu}")
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
