"""Loss + gradient of a token-level policy-gradient loss per second: ours (Flax Qwen3 through the trainer's
log-prob path) vs Tunix's NNX Qwen3 (through its GRPO learner's per-token log-probs), same weights and shapes,
fp32, both jitted ``jax.value_and_grad`` in one process, interleaved.

Tunix is a benchmark-only dependency (not a test or CI one). Its package ``__init__`` imports its trainers and
their dependencies (metrax, ...), so only the two modules used here are loaded (``tunix.models.qwen3.model``,
``tunix.rl.common``); they need ``jaxtyping``. Install:

    .venv/bin/pip install --no-deps google-tunix==0.1.7 && .venv/bin/pip install jaxtyping

(without them the bench prints this and exits 2).

Sides (each call: forward + backward of the loss w.r.t. every parameter of the same mini-batch; no optimizer):

* ``ours``: ``stapo_jax.train.policy.response_log_probs_and_entropy(..., calculate_entropy=False)`` (model
  hidden states -> the response positions -> ``chunked_log_probs_and_entropy``, ``seq_chunk=512``,
  ``vocab_chunk=None``; log-probs only, as the loss needs and as Tunix computes), remat ``--remat`` (default
  ``dots_no_batch``, the ``model.remat`` default). The head keeps its logits for the backward when they fit
  ``SAVED_LOGITS_BYTES`` (the default, as the trainer runs).
* ``ours + entropy``: the same computing the entropy too (``calculate_entropy=True``, what the STAPO trainer
  needs for its S2T mask; the loss ignores it, so this side measures the entropy's cost).
* ``ours, head recompute``: ``ours`` with ``SAVED_LOGITS_BYTES = 0`` while it is traced, i.e. the head's
  backward recomputes every logits tile (the path before the logits were kept; ``--no-recompute-side`` drops it).
* ``tunix``: ``tunix.rl.common.compute_per_token_logps(graphdef, state, prompt, completion, pad_id, eos_id,
  stop_gradient=False)`` as its GRPO learner computes the policy's per-token log-probs: the model's
  ``[B, T, V]`` logits, sliced to the completion, ``selective_log_softmax`` (gather - logsumexp). Tunix remat:
  none (its ``ModelConfig`` default).

Loss on both sides (same function): PPO clipped surrogate (clip 0.2 / 0.28) of the ratio ``exp(log_probs -
old_log_probs)`` with per-sequence advantages, token mean over the response tokens (all R are real tokens:
Tunix derives its completion mask from padding). ``old_log_probs`` are ours + N(0, 0.05) noise.

Checks before timing: the logits of both models on the batch agree within fp32 tolerance (max |diff| printed),
the losses agree and the gradient of the tied embedding agrees (max |diff| printed).

Reported: machine and load (before/after), per side the median [min..max] seconds of ``--repeats``
interleaved calls (one warm-up call each), tokens/s = B·(P+R) / median, the ratio ours/tunix in tokens/s
(> 1: ours faster; per-round spread) and of the process CPU seconds of the same calls (the steadier measure of
work on a shared machine), and the fraction of the measured fp32 matmul peak (``[n, n] @ [n, n]``
in JAX) reached by the model FLOPs 6·(N·B·(P+R) + D·V·B·R) (N = the decoder's matmul weights, the tied
head over the R response positions; attention not counted).

    .venv/bin/python bench/bench_tunix.py                    # 2 layers, Qwen3-0.6B widths, V=151,936, 1 x (256+256)
    .venv/bin/python bench/bench_tunix.py --P 1 --R 511      # the head over (almost) every position on both sides
    .venv/bin/python bench/bench_tunix.py --layers 28        # the full depth
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchutil import (interleaved, load_line, machine_line, median, report_throughput, scan_unroll_arg,  # noqa: E402
                       use_cli_allocator)

import stapo_jax.algo.chunked_logprobs as chunked_logprobs  # noqa: E402
from models.hf import iter_hf_tensors  # noqa: E402
from models.layer_scan import resolve_scan_unroll  # noqa: E402
from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from stapo_jax.train.policy import response_log_probs_and_entropy  # noqa: E402

INSTALL = ("Tunix is not installed (benchmark-only dependency). Install it with\n"
           "    .venv/bin/pip install --no-deps google-tunix==0.1.7 && .venv/bin/pip install jaxtyping\n"
           "and run this script again.")


def import_tunix():
    """``(tunix.models.qwen3.model, tunix.rl.common)`` without running ``tunix/__init__.py`` (which imports the
    trainers' dependencies); exits 2 with the install command when Tunix or ``jaxtyping`` is missing."""
    spec = importlib.util.find_spec("tunix")
    if spec is None or not spec.submodule_search_locations:
        print(INSTALL, file=sys.stderr)
        raise SystemExit(2)
    pkg = types.ModuleType("tunix")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["tunix"] = pkg
    try:
        import tunix.models.qwen3.model as tmodel
        import tunix.rl.common as tcommon
    except ImportError as e:
        print(f"importing Tunix's Qwen3 / rl.common failed: {e}\n{INSTALL}", file=sys.stderr)
        raise SystemExit(2)
    version = "unknown"
    try:
        from importlib.metadata import version as dist_version
        version = dist_version("google-tunix")
    except Exception:  # noqa: BLE001 -- the version is only printed
        pass
    return tmodel, tcommon, version


def tunix_copy(tmodel, model: Qwen3, cfg):
    """Tunix's ``Qwen3`` (fp32, tied head, no remat) holding exactly our weights, through the HF layout
    (``models.hf.iter_hf_tensors``) and Tunix's own HF mapping (transpose, then reshape to its einsum shapes)."""
    tcfg = dataclasses.replace(
        tmodel.ModelConfig.qwen3_0p6b(), num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size, hidden_dim=cfg.intermediate_size, num_heads=cfg.num_attention_heads,
        head_dim=cfg.head_dim, num_kv_heads=cfg.num_key_value_heads, rope_theta=int(cfg.rope_theta),
        norm_eps=cfg.rms_norm_eps, use_tied_embedding=cfg.tie_word_embeddings, dtype=jnp.float32,
        param_dtype=jnp.float32)
    tm = tmodel.Qwen3(tcfg, rngs=nnx.Rngs(1))
    d, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {"q_proj": (d, nh, hd), "k_proj": (d, nkv, hd), "v_proj": (d, nkv, hd), "o_proj": (nh, hd, d)}
    seen = 0
    for name, arr in iter_hf_tensors(model, cfg):
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            target, x = tm.embedder.input_embedding, arr
        elif name == "model.norm.weight":
            target, x = tm.final_norm.w, arr
        else:
            layer = tm.layers[int(parts[2])]
            kind, proj = parts[3], parts[4]
            if kind == "self_attn" and proj in shapes:
                target, x = getattr(layer.attn, proj).w, arr.T.reshape(shapes[proj])
            elif kind == "self_attn":  # q_norm / k_norm
                target, x = getattr(layer.attn, proj).w, arr
            elif kind == "mlp":
                target, x = getattr(layer.mlp, proj).kernel, arr.T
            else:  # input_layernorm / post_attention_layernorm
                target, x = getattr(layer, kind).w, arr
        if tuple(target[...].shape) != tuple(x.shape):
            raise RuntimeError(f"{name}: Tunix shape {tuple(target[...].shape)} != {tuple(x.shape)}")
        target[...] = jnp.asarray(np.ascontiguousarray(x), jnp.float32)
        seen += 1
    n_tunix = len(jax.tree.leaves(nnx.state(tm, nnx.Param)))
    if seen != n_tunix:
        raise RuntimeError(f"copied {seen} tensors into Tunix's {n_tunix} parameters")
    return tm


def pg_loss(log_probs, old_log_probs, advantages, response_mask, clip_low=0.2, clip_high=0.28):
    """Token-mean PPO clipped surrogate ``[B, R]`` -> scalar (the same function on both sides)."""
    ratio_ = jnp.exp(log_probs - old_log_probs)
    a = advantages[:, None]
    per_token = jnp.maximum(-a * ratio_, -a * jnp.clip(ratio_, 1.0 - clip_low, 1.0 + clip_high))
    return jnp.sum(per_token * response_mask) / jnp.maximum(jnp.sum(response_mask), 1.0)


def matmul_peak(n: int, repeats: int = 3) -> float:
    """Measured fp32 ``[n, n] @ [n, n]`` throughput of JAX, GFLOP/s (median of ``repeats``)."""
    rng = np.random.default_rng(1)
    a, b = (jnp.asarray(rng.standard_normal((n, n), dtype=np.float32)) for _ in range(2))
    mm = jax.jit(jnp.matmul)
    return 2 * n ** 3 / median(interleaved({"mm": lambda: mm(a, b).block_until_ready()}, repeats)["mm"]) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen3-0.6B has 28)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the real 151,936)")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--P", type=int, default=256, help="prompt tokens")
    ap.add_argument("--R", type=int, default=256, help="response tokens (the loss is over them)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--remat", default="dots_no_batch", choices=("none", "full", "dots", "dots_no_batch"))
    ap.add_argument("--scan-unroll", default="auto",
                    help="ours: decoder layers per layer-scan iteration (model.scan_unroll; auto = its default)")
    ap.add_argument("--no-recompute-side", action="store_true", help="drop the 'ours, head recompute' side")
    ap.add_argument("--peak-n", type=int, default=2048)
    a = ap.parse_args(argv)
    if a.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3 for a median with spread (got {a.repeats})")
    if a.P < 1 or a.R < 1:
        raise SystemExit(f"--P and --R must be >= 1 (got {a.P}, {a.R})")
    tmodel, tcommon, tunix_version = import_tunix()
    use_cli_allocator()
    print(machine_line(), flush=True)
    print(f"google-tunix {tunix_version}")

    base = from_hf_config("Qwen3-0.6B", dtype="float32", param_dtype="float32")
    cfg = dataclasses.replace(base, num_hidden_layers=a.layers, vocab_size=a.vocab or base.vocab_size,
                              remat=a.remat, scan_unroll=resolve_scan_unroll(scan_unroll_arg(a.scan_unroll)))
    b, p, r, t = a.B, a.P, a.R, a.P + a.R
    d, f, nh, nkv, hd, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    n_dec = a.layers * (d * (nh + 2 * nkv) * hd + nh * hd * d + 3 * d * f)
    model_flops = 6 * (n_dec * b * t + d * v * b * r)
    print(f"shape: Qwen3-0.6B widths D={d} F={f} Nh={nh} Nkv={nkv} H={hd}, L={a.layers}, V={v}, tied head; "
          f"B={b} P={p} R={r} (T={t}); fp32; ours remat {a.remat}, scan_unroll {cfg.scan_unroll}, "
          f"attention {cfg.attention}; logits "
          f"B·R·V·4 = {b * r * v * 4 / 2**20:.0f} MiB vs SAVED_LOGITS_BYTES "
          f"{chunked_logprobs.SAVED_LOGITS_BYTES / 2**20:.0f} MiB "
          f"(kept: {b * r * v * 4 <= chunked_logprobs.SAVED_LOGITS_BYTES}); "
          f"model FLOPs 6·(N·B·T + D·V·B·R) = {model_flops / 1e9:.1f} GFLOP", flush=True)

    t0 = time.perf_counter()
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    tm = tunix_copy(tmodel, model, cfg)
    graphdef, params = nnx.split(model)
    tgraphdef, tparams = nnx.split(tm)
    print(f"init + copy into Tunix: {time.perf_counter() - t0:.1f}s", flush=True)

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, v, (b, t)), jnp.int32)  # no pad id (0): every token is real on both sides
    att = jnp.ones((b, t), bool)
    prompt, completion = ids[:, :p], ids[:, p:]
    mask = jnp.ones((b, r), jnp.float32)
    adv = jnp.asarray(rng.standard_normal(b), jnp.float32)
    pad_id, eos_id = 0, -1

    # logits agreement (fp32), the same inputs as each side's loss
    ours_logits = jax.jit(lambda prm: (lambda m: m(ids, att)[0] @ m.lm_head_weight())(nnx.merge(graphdef, prm)))
    tok, pos, tmask, _ = tcommon.process_ids(prompt, completion, pad_id, eos_id)
    tunix_logits = jax.jit(lambda prm: nnx.merge(tgraphdef, prm)(tok, pos, None, tmask)[0])
    lo, lt = np.asarray(ours_logits(params)), np.asarray(tunix_logits(tparams))
    diff = float(np.abs(lo - lt).max())
    scale = float(np.abs(lo).max())
    print(f"logits ours vs Tunix on the batch [B, T, V]: max |diff| {diff:.2e} (max |logit| {scale:.2f})", flush=True)
    if not diff <= 1e-4 * max(1.0, scale):
        raise SystemExit(f"logits differ beyond fp32 tolerance: max |diff| {diff:.3e}")
    del lo, lt

    def ours_lp(prm, calculate_entropy=False):
        lp, _ = response_log_probs_and_entropy(nnx.merge(graphdef, prm), ids, att, r, seq_chunk=512,
                                               vocab_chunk=None, calculate_entropy=calculate_entropy)
        return lp

    old = jnp.asarray(np.asarray(jax.jit(ours_lp)(params)) + 0.05 * rng.standard_normal((b, r)), jnp.float32)

    def ours_loss(prm, calculate_entropy=False):
        return pg_loss(ours_lp(prm, calculate_entropy), old, adv, mask)

    def tunix_loss(prm):
        lp = tcommon.compute_per_token_logps(tgraphdef, prm, prompt, completion, pad_id, eos_id,
                                             stop_gradient=False)
        return pg_loss(lp, old, adv, mask)

    vg_ours = jax.jit(jax.value_and_grad(ours_loss))
    vg_tunix = jax.jit(jax.value_and_grad(tunix_loss))
    t0 = time.perf_counter()
    c_ours = vg_ours.lower(params).compile()
    t1 = time.perf_counter()
    c_tunix = vg_tunix.lower(tparams).compile()
    t2 = time.perf_counter()
    c_ent = jax.jit(jax.value_and_grad(lambda prm: ours_loss(prm, True))).lower(params).compile()
    sides = {"ours": lambda: jax.block_until_ready(c_ours(params)),
             "ours + entropy": lambda: jax.block_until_ready(c_ent(params))}
    compile_s = {"ours": t1 - t0, "tunix": t2 - t1, "ours + entropy": time.perf_counter() - t2}
    if not a.no_recompute_side:
        saved = chunked_logprobs.SAVED_LOGITS_BYTES
        chunked_logprobs.SAVED_LOGITS_BYTES = 0  # read when traced: this compiled side recomputes the head's logits
        try:
            t0 = time.perf_counter()
            c_rec = jax.jit(jax.value_and_grad(ours_loss)).lower(params).compile()
            compile_s["ours, head recompute"] = time.perf_counter() - t0
        finally:
            chunked_logprobs.SAVED_LOGITS_BYTES = saved
        sides["ours, head recompute"] = lambda: jax.block_until_ready(c_rec(params))
    sides["tunix"] = lambda: jax.block_until_ready(c_tunix(tparams))

    # correctness, untimed: same loss, same gradient of the tied embedding
    (l_o, g_o), (l_t, g_t) = c_ours(params), c_tunix(tparams)
    ge_o = np.asarray(g_o["embed_tokens"]["embedding"][...])
    ge_t = np.asarray(g_t["embedder"]["input_embedding"][...])
    gdiff, gscale = float(np.abs(ge_o - ge_t).max()), float(np.abs(ge_t).max())
    temps = {"ours": c_ours, "ours + entropy": c_ent, "tunix": c_tunix}
    temps |= {} if a.no_recompute_side else {"ours, head recompute": c_rec}
    print(f"loss ours {float(l_o):.7f} vs Tunix {float(l_t):.7f} (|diff| {abs(float(l_o) - float(l_t)):.1e}); "
          f"d loss / d embedding: max |diff| {gdiff:.2e} (max |grad| {gscale:.2e}); compile "
          + ", ".join(f"{k} {s:.1f}s" for k, s in compile_s.items()) + "; XLA temporaries "
          + ", ".join(f"{k} {c.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB" for k, c in temps.items()),
          flush=True)
    if not (np.isclose(float(l_o), float(l_t), rtol=1e-4, atol=1e-6) and gdiff <= 1e-3 * max(gscale, 1e-12)):
        raise SystemExit("ours and Tunix disagree on the loss or its gradient")
    del g_o, g_t, ge_o, ge_t

    cpu: dict[str, list[float]] = {}
    times = interleaved(sides, a.repeats, warmup=1, cpu=cpu)
    peak = matmul_peak(a.peak_n)
    print(f"measured fp32 matmul peak ({a.peak_n}^3, median of 3): jax {peak:.1f} GFLOP/s")
    report_throughput(times, what="loss+grad", tokens=b * t, flops=model_flops, peaks=dict.fromkeys(times, peak),
                      width=22, peak_word="the", cpu=cpu)
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
