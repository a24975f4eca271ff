"""stapo_jax/train/packing.py: packed rows (segment ids, per-sequence positions) give the padded batch's log-probs,
entropies and gradients (fp32, 1e-5), and a packed update equals the padded one for every aggregation mode with
S2T (mini-batch threshold) and for every other recipe."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.qwen3 import Qwen3, Qwen3Config
from stapo_jax.algo.advantages import grpo_advantages
from stapo_jax.train.batching import pack_prompt_response
from stapo_jax.algo.objectives import LOSS_AGG_MODES
from stapo_jax.train.packing import PackedLayout, gather_response_hidden, pack_micro_batches, pack_sequences, rows_bucket
from stapo_jax.train.policy import response_log_probs_and_entropy
from stapo_jax.algo.recipes import get_recipe
from stapo_jax.train.train_step import Batch, TrainState, make_log_prob_fn, make_train_step

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.5,
                  attention="blockwise", attention_block_size=8)
# the update tests: one layer and XLA attention (compile time); packing only needs segment ids, which every
# attention implementation takes (tests/test_attention.py)
CFG_STEP = dataclasses.replace(CFG, num_hidden_layers=1, attention="xla")
SGD = optax.sgd(1.0)
R = 9


def padded(seed=0, b=8):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 64, rng.integers(1, 6))) for _ in range(b)]
    responses = [list(rng.integers(1, 64, n)) for n in rng.integers(0, R + 1, b)]
    responses[1] = []
    responses[2] = list(rng.integers(1, 64, R))
    return pack_prompt_response(prompts, responses, pad_id=0, pad_multiple=1, response_length=R)


def on_device(layout: PackedLayout) -> PackedLayout:
    return jax.tree.map(jnp.asarray, layout)


def test_layout_packs_every_real_token_once_with_restarting_positions():
    p = padded()
    lay = pack_sequences(p["input_ids"], p["attention_mask"], R, row_length=16, num_shards=2)
    m = p["attention_mask"]
    assert lay.input_ids.shape[1] == 16 and lay.input_ids.shape[0] % 2 == 0
    assert int((lay.segment_ids > 0).sum()) == int(m.sum())
    # rows per shard: at least the token count needs, and first-fit decreasing wastes less than one row each
    for s in range(2):
        rows = lay.segment_ids[s * (lay.input_ids.shape[0] // 2):(s + 1) * (lay.input_ids.shape[0] // 2)]
        assert (rows > 0).sum() == m[s * 4:(s + 1) * 4].sum()
    for row_seg, row_pos in zip(lay.segment_ids, lay.positions):
        for sid in set(row_seg.tolist()) - {0}:
            assert row_pos[row_seg == sid].tolist() == list(range(int((row_seg == sid).sum())))
    # each real response token's predicting position holds the token just before it
    flat = lay.input_ids.reshape(2, -1)
    p0 = p["input_ids"].shape[1] - R
    for b in range(8):
        for r in np.flatnonzero(p["response_mask"][b]):
            prev = flat[b // 4, lay.response_index[b, r] + 0]
            assert prev == p["input_ids"][b, p0 + r - 1]
    with pytest.raises(ValueError, match="sequence .* > packing row_length 4"):
        pack_sequences(p["input_ids"], p["attention_mask"], R, row_length=4)
    with pytest.raises(ValueError, match="num_rows=1"):
        pack_sequences(p["input_ids"], p["attention_mask"], R, row_length=16, num_rows=1)


def test_packed_log_probs_entropy_and_gradients_equal_padded():
    model = Qwen3(CFG, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    p = padded(seed=1)
    lay = on_device(pack_sequences(p["input_ids"], p["attention_mask"], R, row_length=20, num_shards=2))
    ids, att = jnp.asarray(p["input_ids"]), jnp.asarray(p["attention_mask"])
    resp = jnp.asarray(p["response_mask"], jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).normal(size=resp.shape), jnp.float32) * resp

    def f(params, packing):
        lp, ent = response_log_probs_and_entropy(nnx.merge(graphdef, params), ids, att, R, packing=packing,
                                                 packing_shards=2, seq_chunk=4)
        return jnp.sum(lp * w) + jnp.sum(ent * w), (lp, ent)

    vg = jax.jit(jax.value_and_grad(f, has_aux=True))
    (v0, (lp0, e0)), g0 = vg(params, None)
    (v1, (lp1, e1)), g1 = vg(params, lay)
    real = np.asarray(resp) > 0
    assert real.sum() > 20 and lay.input_ids.size < ids.size   # packing removed padding
    assert abs(float(v1 - v0)) <= 1e-5 * abs(float(v0))
    np.testing.assert_allclose(np.asarray(lp1)[real], np.asarray(lp0)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(e1)[real], np.asarray(e0)[real], rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(b))))


def test_gather_response_hidden_rejects_indivisible_shards():
    with pytest.raises(ValueError, match="num_shards=3"):
        gather_response_hidden(jnp.zeros((4, 5, 2)), jnp.zeros((8, 3), jnp.int32), 3)


# every aggregation mode with S2T; the other recipes differ from these only in loss constants (clip ranges,
# KL) except entropy20's top-entropy mask, which is the other population quantile
CASES = [("stapo", m) for m in LOSS_AGG_MODES] + [("grpo", "token-mean"), ("entropy20", "seq-mean-token-sum-norm")]


@pytest.mark.parametrize("name,mode", CASES)
def test_packed_update_equals_padded_update(name, mode):
    """The train step with ``Batch.packing`` (the pre-pass, the update and the S2T correction on packed rows,
    two micro-batches as the trainer plans them) gives the padded step's loss, metrics and parameter update."""
    model = Qwen3(CFG_STEP, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    p = padded(seed=3)
    ids, att = jnp.asarray(p["input_ids"]), jnp.asarray(p["attention_mask"])
    rng = np.random.default_rng(4)
    rewards = jnp.asarray([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], jnp.float32)
    lp, _ = make_log_prob_fn()(params, graphdef, ids, att, R)
    batch = Batch(input_ids=ids, attention_mask=att, response_mask=jnp.asarray(p["response_mask"]),
                  advantages=grpo_advantages(rewards, jnp.repeat(jnp.arange(2), 4)),
                  old_log_probs=lp + jnp.asarray(rng.normal(size=lp.shape) * 0.3, jnp.float32))
    recipe = get_recipe(name, loss={"loss_agg_mode": mode}, s2t={"tau_p": 0.05})

    def run(b):
        state = TrainState.create(model, SGD)
        new, m = make_train_step(recipe, SGD, seq_chunk=4, num_micro_batches=2)(state, b)
        return jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new.params, state.params), m

    d0, m0 = run(batch)
    lay = on_device(pack_micro_batches(p["input_ids"], p["attention_mask"], R, num_micro_batches=2))
    assert int((lay.segment_ids > 0).sum()) == int(p["attention_mask"].sum())
    d1, m1 = run(batch.replace(packing=lay))
    assert float(m0["grad_norm"]) > 0
    for key in m0:
        assert abs(float(m1[key]) - float(m0[key])) <= 1e-5 * max(1.0, abs(float(m0[key]))), key
    for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d0)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    if name == "stapo":
        assert float(m0["s2t/masked_frac"]) > 0


def test_micro_batch_layouts_are_bucketed_interleaved_and_shard_local():
    p = padded(seed=5)
    lay = pack_micro_batches(p["input_ids"], p["attention_mask"], R, num_micro_batches=2, num_shards=2)
    t = p["input_ids"].shape[1]
    m = lay.input_ids.shape[0] // 4   # rows per micro-batch per shard
    assert lay.input_ids.shape[1] == t and m in (1, 2) and lay.num_shards == 2
    for j in range(2):   # micro-batch j = rows j, j + 2, ...; its shard s block holds its rows' tokens
        seg = lay.segment_ids[j::2]
        for s in range(2):
            rows = [b for b in range(8) if b % 2 == j][2 * s:2 * s + 2]
            assert (seg[s * m:(s + 1) * m] > 0).sum() == p["attention_mask"][rows].sum()
    assert [rows_bucket(n, 64) for n in (1, 3, 8, 9, 11, 17, 33, 64)] == [1, 3, 8, 10, 12, 20, 40, 64]
    assert rows_bucket(9, 9) == 9   # never more rows than the padded micro-batch
    with pytest.raises(ValueError, match="num_micro_batches=3"):
        pack_micro_batches(p["input_ids"], p["attention_mask"], R, num_micro_batches=3)
