"""Packed (padding-free) vs padded updates on a realistic length mix, both sides in one run.

Length mix: ``bench/data/math500_lengths.json`` holds the Qwen3-tokenizer token counts of the 500 MATH-500
problems and reference solutions. Response lengths are the solution lengths scaled by 15,360 / the longest
(the paper's 15K response cap, so the longest MATH solution becomes a full-length response; median ~1.8K);
prompt lengths are the problem lengths + 20 template tokens, capped at 1,024. A mini-batch draws
``--mini-batch`` sequences (seeded).

1. Tokens computed per useful (real) token of one mini-batch, at full scale (numpy only): padded = every
   sequence padded to the mini-batch's longest prompt + longest response (``stapo_jax.train.batching`` layout, rounded
   to 8); packed = ``stapo_jax.train.packing.pack_sequences`` into rows of 1,024 + 15,360 tokens, per micro-batch of
   ``--micro-batch`` sequences and over the whole mini-batch.
   Also the trainer's own layout (``pack_micro_batches``: every micro-batch in the same M rows of L tokens,
   ``micro_batch_rows``), with the strided micro-batches and with balanced ones (``balanced_row_order``), with
   rows of at most P + R tokens (``long_rows=False``: xla / cudnn / splash) and with one row per micro-batch
   (``long_rows=True``: blockwise, whose cost follows the segments; the trainer's default on CPU), and the
   trainer's default for packed balanced updates: fewer, fuller micro-batches within the tokens of one padded
   micro-batch (``micro_batches.token_budget_micro_batches``), with equal sequence counts (the previous layout) and with
   variable counts (dummy slots fill ``[n_max, R]``; the response slots per sequence are the LM-head pass's
   extra work; at most ``MAX_SEQUENCES_FACTOR`` x the padded micro-batch's sequences, the trainer's default
   ``actor.max_sequences_per_micro_batch``), at ``--micro-batch`` sequences per padded micro-batch and at the paper configs' 1 per device on
   1, 8 and 64 data-parallel shards.
2. Update time through the real trainer update path, scaled down to run on CPU (lengths / ``--scale-down``, a
   small Qwen3 with blockwise attention): ``stapo_jax.train.policy_update.update_policy`` (old-log-prob pass + one STAPO
   mini-batch step of ``--timed-batch`` sequences in micro-batches of ``--timed-micro``, host-side packing
   included) with ``use_remove_padding`` false vs true, interleaved ``--repeats`` times after a warm-up
   (``bench/benchutil.py``); medians, min..max, the packed / padded ratio, and the largest metric difference
   between the two sides as a check.
3. ``--head``: the LM head of the packed update at full scale on the paper layout (the trainer's default token
   budget at 1 sequence per padded micro-batch, one device: micro-batches of variable counts with dummy slots;
   Qwen3-1.7B's D = 2,048, V = 151,936, bf16), compile-only and load-independent, both sides in one run:
   "before" = the previous packed path, hidden states gathered into the ``[n_slots, R, D]`` slot layout and the
   head run there (kept only here, ``log_probs_before_gather_to_slots``); "after" = the library's
   ``response_log_probs_and_entropy(packing=...)`` (head on the ``[M, L, D]`` packed positions, scalars gathered
   back). Printed: head tokens computed per useful response token, XLA cost-analysis FLOPs of one micro-batch's
   head pass (forward, and forward + gradient; compiled with one tile per loop, since cost analysis counts a loop
   body once) and XLA's temporary buffer bytes at the trainer's tile sizes (``seq_chunk`` 512), with ratios.
   Sections 1 and 2 are skipped.

    .venv/bin/python bench/bench_packing.py
    .venv/bin/python bench/bench_packing.py --head
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import benchutil  # noqa: E402
from models.qwen3 import Qwen3  # noqa: E402
from models.qwen3_config import Qwen3Config  # noqa: E402
from stapo_jax.algo.chunked_logprobs import chunked_log_probs_and_entropy  # noqa: E402
from stapo_jax.config.recipes import get_recipe  # noqa: E402
from stapo_jax.train.train_step import make_update_steps  # noqa: E402
from stapo_jax.config.schema import MAX_SEQUENCES_FACTOR  # noqa: E402
from stapo_jax.train.batching import round_up  # noqa: E402
from stapo_jax.train.optim import make_optimizer  # noqa: E402
from stapo_jax.train.packing import (PackedLayout, balanced_row_order, gather_slots, pack_micro_batches,  # noqa: E402
                                    pack_sequences)
from stapo_jax.train.policy import response_log_probs_and_entropy  # noqa: E402
from stapo_jax.train.train_step import TrainState, make_log_prob_fn  # noqa: E402
from stapo_jax.train.micro_batches import token_budget_micro_batches
from stapo_jax.train.policy_update import update_policy  # noqa: E402

LENGTHS = Path(__file__).resolve().parent / "data" / "math500_lengths.json"
MAX_PROMPT, MAX_RESPONSE = 1024, 15360


def length_mix(n: int, seed: int, scale_down: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, response lengths) [n] int of one mini-batch (see the module docstring)."""
    d = json.loads(LENGTHS.read_text())
    sol = np.asarray(d["solution_tokens"], np.float64)
    prob = np.asarray(d["problem_tokens"], np.int64)
    g = np.random.default_rng(seed)
    idx = g.integers(0, len(sol), n)
    resp = np.clip(np.round(sol[idx] * MAX_RESPONSE / sol.max()), 1, MAX_RESPONSE).astype(np.int64)
    prompt = np.minimum(prob[idx] + 20, MAX_PROMPT)
    return np.maximum(prompt // scale_down, 1), np.maximum(resp // scale_down, 1)


def padded_arrays(prompt_len, resp_len, vocab: int, seed: int = 0):
    """input_ids, attention_mask [B, P + R] and response_mask [B, R] of random tokens (batching layout)."""
    p, r = round_up(int(prompt_len.max()), 8), round_up(int(resp_len.max()), 8)
    b = len(prompt_len)
    g = np.random.default_rng(seed)
    ids = g.integers(1, vocab, size=(b, p + r)).astype(np.int32)
    cols = np.arange(p + r)[None]
    mask = (cols >= p - prompt_len[:, None]) & (cols < p + resp_len[:, None])
    return np.where(mask, ids, 0), mask, mask[:, p:], r


def tokens_per_useful(prompt_len, resp_len, micro: int) -> dict:
    useful = int((prompt_len + resp_len).sum())
    p, r = round_up(int(prompt_len.max()), 8), round_up(int(resp_len.max()), 8)
    out = {"padded": len(prompt_len) * (p + r) / useful}
    row = MAX_PROMPT + MAX_RESPONSE
    for name, size in ((f"packed per micro-batch of {micro}", micro), ("packed over the mini-batch", len(prompt_len))):
        rows = 0
        for s in range(0, len(prompt_len), size):
            pl, rl = prompt_len[s:s + size], resp_len[s:s + size]
            ids, mask, _, rr = padded_arrays(pl, rl, 2)
            rows += pack_sequences(ids, mask, rr, row).input_ids.shape[0]
        out[name] = rows * row / useful
    ids, mask, _, rr = padded_arrays(prompt_len, resp_len, 2)
    k = len(prompt_len) // micro
    perm = balanced_row_order(mask.sum(-1), mini_rows=len(prompt_len), num_micro_batches=k)
    for long_rows in (False, True):
        rows = "one row per micro-batch (blockwise)" if long_rows else f"rows of <= P + R = {ids.shape[1]}"
        lay = pack_micro_batches(ids, mask, rr, num_micro_batches=k, long_rows=long_rows)
        out[f"trainer layout, micro-batch of {micro}, {rows}, strided micro-batches"] = lay.input_ids.size / useful
        lay = pack_micro_batches(ids[perm], mask[perm], rr, num_micro_batches=k, long_rows=long_rows)
        out[f"trainer layout, micro-batch of {micro}, {rows}, balanced micro-batches"] = lay.input_ids.size / useful
        for per_micro, shards in ((micro, 1), (1, 1), (1, 8), (1, 64)):
            kb = len(prompt_len) // shards // per_micro
            for variable in (False, True):
                kk, slots = token_budget_micro_batches(mask, mini_rows=len(prompt_len), num_micro_batches=kb,
                                                       num_shards=shards, long_rows=long_rows,
                                                       variable_counts=variable,
                                                       max_sequences=MAX_SEQUENCES_FACTOR * per_micro)
                lay = pack_micro_batches(gather_slots(ids, slots), gather_slots(mask, slots), rr,
                                         num_micro_batches=kk, num_shards=shards, long_rows=long_rows)
                counts = (f"variable counts: {kk} micro-batches of <= {len(slots) // (kk * shards)} sequences, "
                          f"{len(slots) / len(prompt_len):.2f} response slots per sequence" if variable else
                          f"equal counts: {kk} micro-batches of {len(prompt_len) // (kk * shards)}")
                out[f"token budget of {per_micro} padded row(s) per micro-batch, {shards} shard(s), {counts}, "
                    f"{rows}"] = lay.input_ids.size / useful
    return out


def log_probs_before_gather_to_slots(hidden, w, input_ids, response_length, response_index, *, seq_chunk,
                                     vocab_chunk):
    """The bench's "before" side: the previous packed LM-head path (removed from the library). Hidden states
    [M, L, D] are gathered into the [n_slots, R, D] response slots, then the head runs on n_slots x R positions."""
    m, l, d = hidden.shape
    n, r = response_index.shape
    h = jnp.take_along_axis(hidden.reshape(m * l, d), response_index.reshape(n * r, 1), axis=0).reshape(n, r, d)
    return chunked_log_probs_and_entropy(h, w, input_ids[:, input_ids.shape[1] - response_length:],
                                         seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)


class HiddenAsModel:
    """A stand-in for the transformer whose output is the given hidden states, so that the "after" side is the
    library's own ``response_log_probs_and_entropy(packing=...)`` with only the LM head left to compile."""

    def __init__(self, hidden, w):
        self.hidden, self.w = hidden, w

    def __call__(self, *args, **kwargs):
        return self.hidden, None

    def lm_head_weight(self):
        return self.w

    def lm_head_weight_and_layout(self):
        return self.w, "dv"


def head_cost(mini_batch: int, seed: int, d: int, v: int) -> dict:
    """LM-head tokens, FLOPs and temporary bytes of one packed micro-batch, before vs after (module docstring, 3)."""
    pl, rl = length_mix(mini_batch, seed)
    ids, mask, resp, r = padded_arrays(pl, rl, 2)
    kk, slots = token_budget_micro_batches(mask, mini_rows=mini_batch, num_micro_batches=mini_batch)
    lay = pack_micro_batches(gather_slots(ids, slots), gather_slots(mask, slots), r, num_micro_batches=kk)
    n, (m, L) = len(slots) // kk, (lay.input_ids.shape[0] // kk, lay.input_ids.shape[1])
    useful = int(resp.sum())
    print(f"LM head, paper layout: {mini_batch} sequences, R = {r}, {useful} response tokens; trainer default "
          f"{kk} micro-batches of {n} slots (variable counts), packed rows {m} x {L}; D = {d}, V = {v}, bf16")
    tokens = {"padded (no packing)": mini_batch * r, "before (gather to slots)": len(slots) * r,
              "after (packed positions)": kk * m * L}
    for name, t in tokens.items():
        print(f"  head tokens computed per useful response token, {name}: {t / useful:.3f}")
    sds = jax.ShapeDtypeStruct
    i32 = lambda *shape: sds(shape, jnp.int32)  # noqa: E731
    hid, w = sds((m, L, d), jnp.bfloat16), sds((d, v), jnp.bfloat16)
    ids_a, g = i32(n, ids.shape[1]), sds((n, r), jnp.float32)
    packing = PackedLayout(i32(m, L), i32(m, L), i32(m, L), i32(n, r))

    def before(hidden, w, ids, packing, g, **chunks):
        return log_probs_before_gather_to_slots(hidden, w, ids, r, packing.response_index, **chunks)

    def after(hidden, w, ids, packing, g, **chunks):
        return response_log_probs_and_entropy(HiddenAsModel(hidden, w), ids, ids, r, packing=packing, **chunks)

    def compiled(fn, grad, **chunks):
        def loss(hidden, w, ids, packing, g):
            lp, ent = fn(hidden, w, ids, packing, g, **chunks)
            return jnp.sum((lp + ent) * g)
        f = jax.grad(loss, argnums=(0, 1)) if grad else (lambda *a: fn(*a, **chunks))
        return jax.jit(f).lower(hid, w, ids_a, packing, g).compile()

    out = {"tokens_per_useful_response_token": {k: t / useful for k, t in tokens.items()}}
    one_tile = {"seq_chunk": max(L, r), "vocab_chunk": v}
    trainer = {"seq_chunk": 512, "vocab_chunk": None}
    for grad in (False, True):
        what = "forward + gradient" if grad else "forward"
        flops = {s: compiled(fn, grad, **one_tile).cost_analysis()["flops"] for s, fn in
                 (("before", before), ("after", after))}
        temp = {s: compiled(fn, grad, **trainer).memory_analysis().temp_size_in_bytes for s, fn in
                (("before", before), ("after", after))}
        print(f"  head {what}, one micro-batch: XLA FLOPs before {flops['before']:.4g}, after {flops['after']:.4g}: "
              f"after / before = {flops['after'] / flops['before']:.3f}; temp bytes (seq_chunk 512) before "
              f"{temp['before'] / 2**20:.0f} MiB, after {temp['after'] / 2**20:.0f} MiB: after / before = "
              f"{temp['after'] / temp['before']:.3f}")
        print(f"    whole mini-batch ({kk} micro-batches): {kk * flops['before']:.4g} -> {kk * flops['after']:.4g} "
              f"FLOPs; {kk * flops['after'] / useful:.4g} FLOPs per useful response token after "
              f"({kk * flops['before'] / useful:.4g} before)")
        out[what] = {"flops": flops, "temp_bytes": temp}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mini-batch", type=int, default=512, help="sequences per mini-batch (paper: 64 prompts x 8)")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per micro-batch for per-micro packing")
    p.add_argument("--scale-down", type=int, default=32, help="length divisor of the timed CPU run")
    p.add_argument("--timed-batch", type=int, default=16, help="sequences of the timed mini-batch")
    p.add_argument("--timed-micro", type=int, default=8, help="sequences per micro-batch of the timed update")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head", action="store_true", help="only the LM-head section (3), compile-only")
    p.add_argument("--hidden-size", type=int, default=2048, help="D of the --head section (Qwen3-1.7B)")
    p.add_argument("--vocab-size", type=int, default=151936, help="V of the --head section (Qwen3)")
    a = p.parse_args(argv)
    benchutil.use_cli_allocator()
    print(benchutil.machine_line())
    if a.head:
        return {"head": head_cost(a.mini_batch, a.seed, a.hidden_size, a.vocab_size)}
    pl, rl = length_mix(a.mini_batch, a.seed)
    print(f"length mix: {a.mini_batch} sequences, response tokens median {np.median(rl):.0f} mean {rl.mean():.0f} "
          f"max {rl.max()}, prompt median {np.median(pl):.0f} max {pl.max()}")
    ratios = tokens_per_useful(pl, rl, a.micro_batch)
    for k, v in ratios.items():
        print(f"  tokens computed per useful token, {k}: {v:.3f}")

    pl, rl = length_mix(a.timed_batch, a.seed + 1, a.scale_down)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      attention="blockwise", attention_block_size=128)
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    ids, mask, resp, r = padded_arrays(pl, rl, cfg.vocab_size, a.seed)
    adv = np.random.default_rng(a.seed).normal(size=len(pl)).astype(np.float32)
    exp = SimpleNamespace(arrays={"input_ids": ids, "attention_mask": mask, "response_mask": resp,
                                  "advantages": adv}, num_rows=len(pl))
    k = a.timed_batch // a.timed_micro
    opt = make_optimizer(1e-4)
    state = TrainState.create(model, opt)
    kk, slots = token_budget_micro_batches(mask, mini_rows=len(pl), num_micro_batches=k,  # the trainer's default
                                           max_sequences=MAX_SEQUENCES_FACTOR * a.timed_micro)
    fns = {n: (make_update_steps(get_recipe("stapo"), opt, num_micro_batches=n, seq_chunk=128),
               jax.jit(make_log_prob_fn(num_micro_batches=n, seq_chunk=128), static_argnums=(1, 4))) for n in {k, kk}}
    out = {}

    def side(packed):
        n = kk if packed else k

        def f():
            new, out[packed] = update_policy(state, exp, *fns[n], mini_rows=len(pl), num_micro_batches=n,
                                             use_remove_padding=packed, slots=slots if packed else None)
            jax.block_until_ready(new.params)
        return f

    times = benchutil.interleaved({"padded": side(False), "packed": side(True)}, a.repeats)
    lay = pack_micro_batches(gather_slots(ids, slots), gather_slots(mask, slots), r, num_micro_batches=kk)
    diff = max(abs(out[True][m] - out[False][m]) / max(1.0, abs(out[False][m])) for m in out[False]
               if m != "s2t/correction_passes")   # a count of micro-batches
    print(f"timed trainer update (update_policy, lengths / {a.scale_down}): {a.timed_batch} sequences, padded in "
          f"{k} micro-batches {ids.shape} = {ids.size} tokens, packed (trainer default: {kk} micro-batches of "
          f"variable counts, {len(slots)} slots) {lay.input_ids.shape} = {lay.input_ids.size} tokens, real "
          f"{int(mask.sum())}; max relative metric difference {diff:.1e}")
    for name, v in times.items():
        print(f"  {name}: {benchutil.summary(v)}")
    print(f"  packed / padded update time = {benchutil.ratio(times['packed'], times['padded'])}")
    print(benchutil.load_line("at end"))
    med = {name: benchutil.median(v) for name, v in times.items()}
    return {"tokens_per_useful": ratios, "time": med}


if __name__ == "__main__":
    main()
