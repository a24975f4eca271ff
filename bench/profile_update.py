"""Where the work goes in one update step and one decode step: XLA's per-program cost analysis
(``compiled.cost_analysis()`` FLOPs and bytes, ``compiled.memory_analysis()`` temporaries) of each piece,
next to an analytic count. Nothing is executed (abstract shapes, compile only), so the numbers do not depend
on the machine's load.

XLA's cost analysis counts the body of a ``while`` loop (``lax.scan`` / ``fori_loop``) once, whatever its trip
count. Every loop is therefore given a trip count of 1: one decoder layer (``--layers 1``), one micro-batch,
``seq_chunk`` = the response length and ``vocab_chunk=None`` in the head; the one loop that cannot be (the head's
custom backward always walks ``BACKWARD_VOCAB_CHUNK``-wide vocabulary tiles, ceil(V / 8192) = 19 at 0.6B) is
corrected: its measured body (head forward + backward minus head forward) is counted ceil(V / 8192) times
(with the head's logits kept or recomputed as the update does: ``--saved-logits-mib``), in the head row and in
every update step (twice in the correction's worst case: the redo has its own). The per-layer figures are then
scaled to ``--target-layers`` (28 = Qwen3-0.6B) analytically: update(L) = update(1) + (L - 1) x layer.
A ``lax.cond`` (the S2T correction's redo branch) is counted as XLA counts it (the larger branch), i.e. the
worst case in which every micro-batch is redone.

Pieces (shape: Qwen3-0.6B widths, B x (P + R) tokens, float32):

* model forward (hidden states) and forward + backward of the decoder (loss = <hidden, g>);
* the log-prob/entropy head over the R response positions: forward, and forward + the custom backward
  (gradient of sum(log_probs * g) w.r.t. hidden and the tied head), with the logits kept for the backward
  (when they fit ``SAVED_LOGITS_BYTES``, the default) and recomputed in it (``max_saved_logits_bytes=0``);
* the optimizer (AdamW update + apply) over all parameters;
* the full update step ``stapo_jax.train.train_step.make_train_step``: justrl (no mask) and stapo (correction,
  prepass); the rest (S2T statistics and correction, diagnostics, gradient norm) is the difference;
* the old-log-prob pass ``make_log_prob_fn``;
* remat policies (``Qwen3Config.remat``): FLOPs and temporaries of the justrl update;
* one decode step of the rollout engine (``decode_fns.step_fn``) at ``--decode-batch`` slots.

Analytic: N_layer = D (Nh + 2 Nkv) H + Nh H D + 3 D F matmul weights per layer; forward 2 N_layer tokens +
attention 4 B T^2 Nh H (both score and value matmuls over the full T x T square, as XLA computes them);
head 2 D V R_tokens (+ ~5 V R elementwise for softmax/entropy); backward 2x forward (6 N tokens in all).

    .venv/bin/python bench/profile_update.py                       # B=2, P=R=128, one layer, V=151,936
    .venv/bin/python bench/profile_update.py --B 1 --P 8 --R 8 --vocab 1024 --skip-remat   # quick
    .venv/bin/python bench/profile_update.py --saved-logits-mib 0   # the update as before the logits were kept
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from benchutil import load_line, machine_line, use_cli_allocator  # noqa: E402
from flax import nnx  # noqa: E402

from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from stapo_jax.assets import qwen3_config_dir  # noqa: E402
import stapo_jax.algo.chunked_logprobs as chunked_logprobs  # noqa: E402
from stapo_jax.algo.chunked_logprobs import BACKWARD_VOCAB_CHUNK, chunked_log_probs_and_entropy  # noqa: E402
from stapo_jax.config.recipes import get_recipe  # noqa: E402
from stapo_jax.train.train_step import Batch, TrainState, make_log_prob_fn, make_train_step  # noqa: E402


def cost(jitted, *args) -> dict:
    """FLOPs, bytes accessed (XLA cost analysis) and temporaries (memory analysis) of ``jitted`` lowered on
    abstract ``args``; compile seconds."""
    t0 = time.perf_counter()
    c = jitted.lower(*args).compile()
    sec = time.perf_counter() - t0
    ca = c.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    ma = c.memory_analysis()
    return dict(flops=float(ca.get("flops", 0.0)), bytes=float(ca.get("bytes accessed", 0.0)),
                temp=float(ma.temp_size_in_bytes), compile_s=sec)


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--P", type=int, default=128)
    ap.add_argument("--R", type=int, default=128)
    ap.add_argument("--layers", type=int, default=1, help="layers compiled (keep 1: loops are counted once)")
    ap.add_argument("--target-layers", type=int, default=28)
    ap.add_argument("--vocab", type=int, default=0, help="0: the real 151,936")
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--decode-context", type=int, default=256)
    ap.add_argument("--skip-remat", action="store_true")
    ap.add_argument("--remat-layers", type=int, default=6,
                    help="layers of the remat memory run, compared with 2 layers (a 1-layer scan is compiled "
                         "differently); FLOPs are taken at 1 layer")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--saved-logits-mib", type=float, default=None,
                    help="stapo_jax.algo.chunked_logprobs.SAVED_LOGITS_BYTES in MiB for the update steps "
                         "(default: as is, "
                         "512; 0: the head's backward recomputes its logits)")
    a = ap.parse_args()
    if a.saved_logits_mib is not None:
        chunked_logprobs.SAVED_LOGITS_BYTES = int(a.saved_logits_mib * 2**20)
    use_cli_allocator()
    print(machine_line(), flush=True)
    base = from_hf_config(str(qwen3_config_dir() / "Qwen3-0.6B.json"), dtype="float32", param_dtype="float32")
    cfg = dataclasses.replace(base, num_hidden_layers=a.layers, vocab_size=a.vocab or base.vocab_size,
                              max_position_embeddings=max(a.P + a.R, a.decode_context))
    d, f, nh, nkv, hd, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)
    b, t, r = a.B, a.P + a.R, a.R
    toks = b * t
    print(f"shape: Qwen3-0.6B widths D={d} F={f} Nh={nh} Nkv={nkv} H={hd} V={v}, tied head; B={b} P={a.P} R={r} "
          f"(T={t}); {a.layers} layer(s) compiled, scaled to {a.target_layers}; fp32", flush=True)

    def abstract_model(c):
        return nnx.eval_shape(lambda: Qwen3(c, rngs=nnx.Rngs(0)))

    model = abstract_model(cfg)
    graphdef, params = nnx.split(model)
    opt = optax.adamw(1e-6)
    ids, att = spec((b, t), jnp.int32), spec((b, t), jnp.bool_)
    rows = []  # (piece, measured flops, analytic flops, note)

    # analytic
    n_layer = d * (nh + 2 * nkv) * hd + nh * hd * d + 3 * d * f
    attn = 4 * b * t * t * nh * hd
    fwd_layer_an = 2 * n_layer * toks + attn
    head_an = 2 * d * v * b * r

    def fwd(p, ids, att):
        return nnx.merge(graphdef, p)(ids, att)[0]

    c_fwd = cost(jax.jit(fwd), params, ids, att)
    g_h = spec((b, t, d), jnp.float32)

    def fwd_bwd(p, ids, att, g):
        return jax.grad(lambda p: jnp.sum(fwd(p, ids, att) * g))(p)

    c_fb = cost(jax.jit(fwd_bwd), params, ids, att, g_h)
    rows.append(("decoder forward, 1 layer", c_fwd, fwd_layer_an, ""))
    rows.append(("decoder forward + backward, 1 layer", c_fb, 3 * fwd_layer_an, "incl. remat recompute if any"))

    h_r, w, ids_r = spec((b, r, d), jnp.float32), spec((d, v), jnp.float32), spec((b, r), jnp.int32)

    def head(h, w, ids, budget=None):
        return chunked_log_probs_and_entropy(h, w, ids, seq_chunk=r, vocab_chunk=None, max_saved_logits_bytes=budget)

    def head_fb(budget):
        return lambda h, w, ids, g: jax.grad(lambda h, w: jnp.sum(head(h, w, ids, budget)[0] * g),
                                             argnums=(0, 1))(h, w)

    c_head = cost(jax.jit(head), h_r, w, ids_r)
    n_v = -(-v // BACKWARD_VOCAB_CHUNK)
    kept = b * r * v * 4 <= chunked_logprobs.SAVED_LOGITS_BYTES
    heads = {}
    for mode, budget in (("kept", b * r * v * 4), ("recomputed", 0)):
        c_hfb = cost(jax.jit(head_fb(budget)), h_r, w, ids_r, spec((b, r), jnp.float32))
        fix = (n_v - 1) * (c_hfb["flops"] - c_head["flops"])  # the uncounted backward vocabulary tiles
        heads[mode] = (dict(c_hfb, flops=c_hfb["flops"] + fix), fix)
    c_head_fb, loop_fix = heads["kept" if kept else "recomputed"]
    rows.append(("log-prob/entropy head forward (R tokens)", c_head, head_an, ""))
    rows.append((f"head forward + custom backward ({'logits kept' if kept else 'logits recomputed'}: the update's)",
                 c_head_fb, 3 * head_an,
                 f"B·R·V·4 = {b * r * v * 4 / 2**20:.0f} MiB vs SAVED_LOGITS_BYTES "
                 f"{chunked_logprobs.SAVED_LOGITS_BYTES / 2**20:.0f} MiB; {n_v} backward vocab tiles counted"))
    other = "recomputed" if kept else "kept"
    rows.append((f"head forward + custom backward (logits {other})", heads[other][0], 3 * head_an,
                 "for comparison, not in the update"))

    opt_state = jax.eval_shape(opt.init, params)

    def opt_step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    n_all = sum(x.size for x in jax.tree.leaves(params))
    rows.append(("AdamW update + apply (all params)", cost(jax.jit(opt_step), params, opt_state, params),
                 None, f"{n_all / 1e6:.1f} M params, ~15-20 flops/param"))

    state = jax.eval_shape(lambda: TrainState.create(Qwen3(cfg, rngs=nnx.Rngs(0)), opt))
    f32 = jnp.float32
    batch = Batch(input_ids=ids, attention_mask=att, response_mask=spec((b, r), f32), advantages=spec((b,), f32),
                  old_log_probs=spec((b, r), f32), old_entropy=spec((b, r), f32))
    upd_an = 3 * (fwd_layer_an + head_an)
    steps = {}
    for label, recipe, n_bwd in (
            ("update step, justrl (no mask)", get_recipe("justrl"), 1),
            ("update step, stapo correction (worst-case redo, 1 layer)", get_recipe("stapo"), 2),
            ("update step, stapo prepass", get_recipe("stapo", s2t={"minibatch_method": "prepass"}), 1)):
        step = make_train_step(recipe, opt, num_micro_batches=1, seq_chunk=r, vocab_chunk=None)
        c_step = cost(step, state, batch)
        steps[label] = dict(c_step, flops=c_step["flops"] + n_bwd * loop_fix)
        rows.append((label, steps[label], upd_an, ""))
    lp_fn = jax.jit(make_log_prob_fn(seq_chunk=r, vocab_chunk=None), static_argnums=(1, 4))
    rows.append(("old-log-prob pass (forward + head)", cost(lp_fn, params, graphdef, ids, att, r),
                 fwd_layer_an + head_an, ""))

    print("\n| piece (1 layer) | XLA GFLOP | analytic GFLOP | XLA / analytic | GB accessed | temporaries MiB | "
          "compile s | note |")
    print("|---|---|---|---|---|---|---|---|")
    for label, c, an, note in rows:
        rat = f"{c['flops'] / an:.2f}" if an else "-"
        ans = f"{an / 1e9:.2f}" if an else "-"
        print(f"| {label} | {c['flops'] / 1e9:.2f} | {ans} | {rat} | {c['bytes'] / 1e9:.2f} | "
              f"{c['temp'] / 2**20:.0f} | {c['compile_s']:.1f} | {note} |")

    # breakdown of one update, scaled to target layers: per extra layer, its decoder fwd+bwd and its optimizer
    L = a.target_layers
    layer_fb, head_fb_flops, opt1 = c_fb["flops"], c_head_fb["flops"], rows[5][1]["flops"]
    layer_params = (n_all - v * d - d) / a.layers  # all but the (tied) embedding and the final norm
    opt_layer = opt1 / n_all * layer_params
    extra = L - a.layers
    total_an = L * 3 * fwd_layer_an + 3 * head_an
    print(f"\nbreakdown of one update, scaled to {L} layers (B={b}, T={t}, R={r}); analytic 6·N·tokens + attention "
          f"+ head = {total_an / 1e9:.1f} GFLOP (no optimizer):")
    for label in steps:
        step1 = steps[label]["flops"]
        rest = step1 - a.layers * layer_fb - head_fb_flops - opt1
        tot = step1 + extra * (layer_fb + opt_layer)
        dec, opt_part = L * layer_fb, opt1 + extra * opt_layer
        print(f"  {label}: total {tot / 1e9:.1f} GFLOP = {tot / total_an:.2f}x analytic (goal <= 1.4x)")
        print(f"    decoder fwd+bwd {dec / tot:6.1%} | head fwd+custom bwd {head_fb_flops / tot:6.1%} | optimizer "
              f"{opt_part / tot:6.1%} | rest (loss, S2T statistics/correction, diagnostics, grad norm/finite "
              f"check, accumulation) {rest / tot:6.1%} ({rest / 1e9:.3f} GFLOP, {rest / n_all:.0f} flop/param)")

    if not a.skip_remat:
        print(f"\n| remat policy | justrl update GFLOP (1 layer) | temporaries MiB at 2 / {a.remat_layers} layers | "
              f"per layer MiB |")
        print("|---|---|---|---|")
        for pol in ("none", "dots_no_batch", "dots", "full"):
            got = []
            for n in (1, 2, a.remat_layers):
                c2 = dataclasses.replace(cfg, remat=pol, num_hidden_layers=n)
                st = jax.eval_shape(lambda c2=c2: TrainState.create(Qwen3(c2, rngs=nnx.Rngs(0)), opt))
                got.append(cost(make_train_step(get_recipe("justrl"), opt, num_micro_batches=1, seq_chunk=r,
                                                vocab_chunk=None), st, batch))
            per = (got[2]["temp"] - got[1]["temp"]) / max(a.remat_layers - 2, 1)
            print(f"| {pol} | {(got[0]['flops'] + loop_fix) / 1e9:.2f} | {got[1]['temp'] / 2**20:.0f} / "
                  f"{got[2]['temp'] / 2**20:.0f} | {per / 2**20:.1f} |", flush=True)

    if not a.skip_decode:
        from stapo_jax.rollout.decode_fns import step_fn
        from stapo_jax.rollout.engine import EngineConfig, Qwen3Engine
        from stapo_jax.rollout.sampling import SamplingParams

        dcfg = dataclasses.replace(cfg, eos_token_id=None, bos_token_id=None, pad_token_id=0)
        real = Qwen3(dcfg, rngs=nnx.Rngs(0))  # the engine places real parameters
        nb = a.decode_batch
        for greedy in (True, False):
            sp = SamplingParams(greedy=True) if greedy else SamplingParams(temperature=1.0, top_p=1.0)
            eng = Qwen3Engine(real, EngineConfig(max_concurrent_decodes=nb, max_prefill_length=a.decode_context // 2,
                                                 max_decode_length=a.decode_context // 2, sampling=sp,
                                                 eos_token_ids=()))
            dparams = eng.place_params(nnx.split(real)[1])
            dstate = eng.init_decode_state()
            cd = cost(step_fn, eng.decode_spec, dparams, dstate, sp, 1)
            ctx = eng.config.cache_length if hasattr(eng.config, "cache_length") else a.decode_context
            an_layer = 2 * n_layer * nb + 4 * nb * ctx * nh * hd
            an_head = 2 * d * v * nb
            tot = cd["flops"] + (L - a.layers) * an_layer
            print(f"\ndecode step ({'greedy' if greedy else 'sampled, T=1'}), {nb} slots, cache {ctx}: XLA "
                  f"{cd['flops'] / 1e9:.2f} GFLOP at 1 layer vs analytic {(an_layer + an_head) / 1e9:.2f} "
                  f"(head {an_head / 1e9:.2f}); scaled to {L} layers {tot / 1e9:.1f} GFLOP = "
                  f"{tot / (L * an_layer + an_head):.2f}x analytic; bytes {cd['bytes'] / 1e9:.2f} GB; "
                  f"temporaries {cd['temp'] / 2**20:.0f} MiB")
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
