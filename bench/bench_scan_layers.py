"""Loss + gradient with the decoder layers applied by ``jax.lax.scan`` over their stacked ``[L, ...]`` parameters
(``models.qwen3.Qwen3``, what the trainer runs) vs a Python loop over one parameter state per layer (Tunix's and
HF's per-layer modules; MaxText's ``scan_layers=False``) and two unrolled loops over the stack: same weights, same
remat policy, same head and loss, all jitted ``jax.value_and_grad`` in one process, interleaved. The measurement
behind keeping the scan (DESIGN.md).

What differs between the sides is only how the layer weights reach the layer: inside the scan every iteration
reads its layer's slice of the stacked weights (a copy on XLA:CPU, forward and again in the remat backward),
writes its gradients into the stacked gradient and its saved activations into stacked residual buffers; the
per-layer loop reads each layer's own buffers and unrolls the layers into one program (longer compile).

Sides (each call: forward + backward of the loss w.r.t. every parameter; no optimizer):

* ``scan``: ``Qwen3.__call__`` on the stacked parameters (``jax.lax.scan``, ``model.remat`` = ``--remat``).
* ``per-layer``: the same ``DecoderLayer`` modules, one ``nnx.State`` per layer (sliced from the stack once,
  before timing), applied in a Python loop, each wrapped in the same ``models.qwen3_layers.remat_layer`` policy.
* ``unrolled``: the stacked parameters under ``jax.lax.scan(..., unroll=True)`` (the stack kept, the loop
  unrolled at compile time, so every slice index is a constant).
* ``sliced``: the stacked parameters, a Python loop over static slices ``leaf[i]`` of the stack (MaxText's
  ``scan_layers=False`` compute on the scan's parameter layout).
* ``unroll<k>`` (one per ``--unrolls`` value): the stacked parameters under ``jax.lax.scan(..., unroll=k)``,
  ``k`` layers per loop iteration (``model.scan_unroll``, :mod:`models.layer_scan`, which this bench sets).

Loss on both sides: minus the mean log-prob of the next token over the last R positions, through the trainer's
head (``stapo_jax.algo.logprobs.chunked_log_probs_and_entropy``, tied embedding, ``calculate_entropy=False``).
Checks before timing: each side's loss equals the scan's, and so do its gradients (max |diff| of every layer leaf
and of the embedding, printed).

Reported: machine and load, per side the median [min..max] seconds of ``--repeats`` interleaved calls, each
other side's speed against the scan (> 1: faster than the scan) with its per-round spread, compile seconds and XLA
temporaries.

    .venv/bin/python bench/bench_scan_layers.py                         # 4 layers, Qwen3-0.6B widths, 1 x 512
    .venv/bin/python bench/bench_scan_layers.py --layers 28 --repeats 5 # the full depth
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from benchutil import interleaved, load_line, machine_line, ratio, summary, use_cli_allocator  # noqa: E402
from flax import nnx  # noqa: E402

from models.attention import segment_ids_from_mask  # noqa: E402
from models.decode import unstack_layers  # noqa: E402
from models.presets import from_hf_config  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from models.qwen3_layers import positions_from_mask, remat_layer, rope_cos_sin  # noqa: E402
from stapo_jax.algo.chunked_logprobs import chunked_log_probs_and_entropy  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-0.6B has 28)")
    ap.add_argument("--unrolls", default="4", help="comma-separated jax.lax.scan unroll values to add as sides "
                    "(layers per iteration; '' for none)")
    ap.add_argument("--vocab", type=int, default=0, help="vocabulary size (0: the real 151,936)")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--R", type=int, default=256, help="positions the loss reads (the response)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--remat", default="dots_no_batch", choices=("none", "full", "dots", "dots_no_batch"))
    a = ap.parse_args(argv)
    if a.repeats < 3:
        raise SystemExit(f"--repeats must be >= 3 for a median with spread (got {a.repeats})")
    if not 1 <= a.R < a.T:
        raise SystemExit(f"--R must be in [1, --T - 1] (got R={a.R}, T={a.T})")
    use_cli_allocator()
    print(machine_line(), flush=True)

    base = from_hf_config("Qwen3-0.6B", dtype="float32", param_dtype="float32")
    cfg = dataclasses.replace(base, num_hidden_layers=a.layers, vocab_size=a.vocab or base.vocab_size,
                              remat=a.remat, scan_unroll=1)  # the "scan" side: the rolled loop
    unrolls = [int(k) for k in a.unrolls.split(",") if k.strip()]
    if any(k < 1 for k in unrolls):
        raise SystemExit(f"--unrolls must be ints >= 1 (got {a.unrolls!r})")
    if not cfg.tie_word_embeddings:
        raise SystemExit("this bench assumes a tied head (Qwen3-0.6B's)")
    b, t, r = a.B, a.T, a.R
    print(f"shape: Qwen3-0.6B widths, L={a.layers}, V={cfg.vocab_size}, tied head; B={b} T={t} R={r}; fp32; "
          f"remat {a.remat}, attention {cfg.attention}", flush=True)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    layer_def, stacked = nnx.split(model.layers)
    embed_def, embed_state = nnx.split(model.embed_tokens)
    norm_def, norm_state = nnx.split(model.norm)
    per_layer = list(unstack_layers(stacked))  # one state per layer, copies of the stack's slices

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, cfg.vocab_size, (b, t)), jnp.int32)
    att = jnp.ones((b, t), bool)
    cos, sin = rope_cos_sin(positions_from_mask(att), cfg.head_dim, cfg.rope_theta)
    seg = segment_ids_from_mask(att).astype(jnp.int32)

    def loss_from_hidden(hidden, embedding):
        lp = chunked_log_probs_and_entropy(hidden[:, t - r - 1:t - 1], embedding, ids[:, t - r:],
                                           weight_layout="vd", calculate_entropy=False)[0]
        return -jnp.mean(lp)

    def scan_loss(prm):
        m = nnx.merge(graphdef, prm)
        return loss_from_hidden(m(ids, att)[0], m.embed_tokens.embedding[...])

    def body(h, st):
        return nnx.merge(layer_def, st)(h, cos, sin, None, segment_ids=seg)[0]

    step = remat_layer(body, a.remat)

    def loss_over(run_layers):
        """The loss with the decoder layers applied by ``run_layers(x, layers)`` to ``(embedding, norm, layers)``."""
        def loss(prm):
            emb, norm, layers = prm
            embed = nnx.merge(embed_def, emb)
            return loss_from_hidden(nnx.merge(norm_def, norm)(run_layers(embed(ids), layers)), embed.embedding[...])
        return loss

    def per_layer_loop(x, layers):
        for st in layers:
            x = step(x, st)
        return x

    def sliced_loop(x, stk):
        for i in range(a.layers):
            x = step(x, jax.tree.map(lambda v, i=i: v[i], stk))
        return x

    def scan_unrolled_by(k):  # k layers per iteration (True: all)
        return lambda x, stk: jax.lax.scan(lambda h, st: (step(h, st), None), x, stk, unroll=k)[0]

    args = {"scan": params, "per-layer": (embed_state, norm_state, per_layer),
            "unrolled": (embed_state, norm_state, stacked), "sliced": (embed_state, norm_state, stacked),
            **{f"unroll{k}": (embed_state, norm_state, stacked) for k in unrolls}}
    fns = {"scan": scan_loss, "per-layer": loss_over(per_layer_loop), "unrolled": loss_over(scan_unrolled_by(True)),
           "sliced": loss_over(sliced_loop), **{f"unroll{k}": loss_over(scan_unrolled_by(k)) for k in unrolls}}
    others = [k for k in fns if k != "scan"]
    compiled, compile_s = {}, {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        compiled[name] = jax.jit(jax.value_and_grad(fn)).lower(args[name]).compile()
        compile_s[name] = time.perf_counter() - t0
    print("compile " + ", ".join(f"{k} {s:.1f}s" for k, s in compile_s.items()) + "; XLA temporaries "
          + ", ".join(f"{k} {c.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB" for k, c in compiled.items()),
          flush=True)

    l_s, g_s = compiled["scan"](params)
    for k in others:
        l_k, (g_emb, _, g_layers) = compiled[k](args[k])
        if k == "per-layer":
            g_layers = jax.tree.map(lambda *xs: jnp.stack(xs), *g_layers)
        layer_diff = max(float(jnp.abs(x - y).max()) for x, y in
                         zip(jax.tree.leaves(g_s["layers"]), jax.tree.leaves(g_layers)))
        emb_diff = float(jnp.abs(g_s["embed_tokens"]["embedding"][...] - g_emb["embedding"][...]).max())
        print(f"loss scan {float(l_s):.7f} vs {k} {float(l_k):.7f}; gradients max |diff|: layers {layer_diff:.2e}, "
              f"embedding {emb_diff:.2e}", flush=True)
        if not (np.isclose(float(l_s), float(l_k), rtol=1e-5, atol=1e-6) and max(layer_diff, emb_diff) <= 1e-4):
            raise SystemExit(f"the scan and the {k} loop disagree on the loss or its gradient")
        del g_emb, g_layers
    del g_s

    sides = {k: (lambda c=c, x=args[k]: jax.block_until_ready(c(x))) for k, c in compiled.items()}
    times = interleaved(sides, a.repeats, warmup=1)
    for k, ts in times.items():
        print(f"{k:10s} loss+grad {summary(ts, 's')}: {b * t / np.median(ts):.1f} tok/s")
    for k in others:
        print(f"ratio {k} / scan (speed) = {ratio(times['scan'], times[k])} "
              "(median [per-round min..max]; > 1: faster than the scan)")
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
