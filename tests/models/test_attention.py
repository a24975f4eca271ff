"""models/attention.py (xla / blockwise / splash-interpret / cudnn selection) and the Qwen3 model with blockwise
attention against transformers' PyTorch Qwen3 (logits, greedy generate) in float32."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from fixtures_hf import hf_logits, hf_tied, padded_batch  # noqa: F401 (fixtures)
from models.attention import (AttentionError, block_ranges, dot_product_attention, resolve_implementation,
                              segment_mask, xla_attention)
from models.decode import greedy_generate
from models.hf import load_hf_checkpoint
from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.core.errors import ConfigError
from models.sharding import make_mesh

REL = 1e-5


def _segments():
    """[4, 37] segment ids: left padding, right padding, both, and a row packing 3 sequences (+ padding)."""
    seg = np.ones((4, 37), np.int32)
    seg[0, :9] = 0                      # left-padded
    seg[1, 25:] = 0                     # right-padded (ragged)
    seg[2, :3] = 0
    seg[2, 30:] = 0                     # prompt left-padded + response right-padded
    seg[3, 11:20] = 2                   # packed: 3 sequences, then padding
    seg[3, 20:33] = 3
    seg[3, 33:] = 0
    return jnp.asarray(seg)


def _inputs(n, nkv, seed=0, t=37, h=8):
    g = np.random.default_rng(seed)
    q = jnp.asarray(g.normal(size=(4, t, n, h)), jnp.float32)
    k = jnp.asarray(g.normal(size=(4, t, nkv, h)), jnp.float32)
    v = jnp.asarray(g.normal(size=(4, t, nkv, h)), jnp.float32)
    w = jnp.asarray(g.normal(size=(4, t, n, h)), jnp.float32)
    return q, k, v, w


def _value_and_grads(impl, q, k, v, w, seg, **kw):
    def loss(q, k, v):  # padding queries' outputs are unspecified: weight only the real ones
        out = dot_product_attention(q, k, v, seg, implementation=impl, **kw)
        return jnp.sum(out * w * (seg > 0)[:, :, None, None]), out

    (val, out), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)
    return val, out, grads


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _assert_close_to_reference(got, ref, seg, w):
    """(value, output, grads) of an implementation vs the reference's: the value within REL of the weighted output's
    magnitude, the outputs at real queries and every gradient within REL (and the gradients far from zero)."""
    (val, out, grads), (ref_val, ref_out, ref_grads) = got, ref
    real = np.asarray(seg) > 0
    assert abs(float(val - ref_val)) <= REL * float(jnp.sum(jnp.abs(ref_out * w)[real]))
    assert _rel(out[real], ref_out[real]) <= REL
    for g, r in zip(grads, ref_grads):
        assert float(jnp.max(jnp.abs(r))) > 0.1
        assert _rel(g, r) <= REL


@pytest.mark.parametrize("impl,kw,heads", [
    ("blockwise", dict(block_size=8), (4, 2)),      # GQA, 5 blocks with a padded tail block
    ("blockwise", dict(block_size=16), (4, 1)),     # MQA
    ("blockwise", dict(block_size=64), (2, 2)),     # MHA, one block
    ("splash", dict(block_size=128, interpret=True), (4, 2)),  # Pallas interpret mode on CPU
])
def test_attention_matches_xla_reference_values_and_gradients(impl, kw, heads):
    seg = _segments()
    q, k, v, w = _inputs(*heads)
    ref = _value_and_grads("xla", q, k, v, w, seg)
    val, out, grads = _value_and_grads(impl, q, k, v, w, seg, **kw)
    _assert_close_to_reference((val, out, grads), ref, seg, w)
    # packing = running each sequence alone: row 3's second sequence attends to nothing outside itself
    alone = dot_product_attention(q[3:4, 11:20], k[3:4, 11:20], v[3:4, 11:20], jnp.ones((1, 9), jnp.int32),
                                  implementation="xla")
    assert _rel(out[3, 11:20], alone[0]) <= REL


@pytest.mark.parametrize("query_block,causal,heads", [
    (8, True, (4, 2)),      # 5 query blocks, the last one ragged (37 = 4 x 8 + 5); GQA
    (5, True, (4, 1)),      # 8 blocks of 5 (the last of 2); MQA
    (37, True, (2, 2)),     # one block of all T
    (8, False, (4, 2)),     # not causal: one block over every key
])
def test_xla_query_blocks_equal_jax_nn_attention_in_values_and_gradients(query_block, causal, heads):
    """xla_attention's causal query blocks (each scoring only the keys up to its end) = jax.nn's xla attention
    with the full [B, 1, T, T] segment mask, on padded and packed rows, values and gradients."""
    seg = _segments()
    q, k, v, w = _inputs(*heads, seed=5)
    real = (seg > 0)[:, :, None, None]

    def ours(q, k, v):
        out = xla_attention(q, k, v, seg, scale=0.3, causal=causal, query_block=query_block)
        return jnp.sum(out * w * real), out

    def ref(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, mask=segment_mask(seg, causal), scale=0.3, implementation="xla")
        return jnp.sum(out * w * real), out

    (val, out), grads = jax.value_and_grad(ours, (0, 1, 2), has_aux=True)(q, k, v)
    (ref_val, ref_out), ref_grads = jax.value_and_grad(ref, (0, 1, 2), has_aux=True)(q, k, v)
    _assert_close_to_reference((val, out, grads), (ref_val, ref_out, ref_grads), seg, w)
    assert bool(jnp.all(jnp.isfinite(out)))                        # padding queries: finite
    with pytest.raises(AttentionError, match="query_block=0"):
        xla_attention(q, k, v, seg, scale=0.3, query_block=0)


def test_xla_attention_unrolls_at_most_the_maximum_number_of_query_blocks():
    """T = 64 with query_block 1 would be 64 blocks; the block grows to ceil(T / 16) = 4 tokens instead, so the
    traced program holds 16 blocks (two dots each), and the result still equals the one-block run."""
    seg = jnp.ones((1, 64), jnp.int32)
    q, k, v, _ = _inputs(2, 1, t=64)
    q, k, v = q[:1], k[:1], v[:1]
    jaxpr = jax.make_jaxpr(lambda q, k, v: xla_attention(q, k, v, seg, scale=0.5, query_block=1))(q, k, v)
    assert sum(e.primitive.name == "dot_general" for e in jaxpr.eqns) == 2 * 16
    one = xla_attention(q, k, v, seg, scale=0.5, query_block=64)
    assert _rel(xla_attention(q, k, v, seg, scale=0.5, query_block=1), one) <= REL


def test_blockwise_skips_key_blocks_outside_the_segments_and_stays_exact():
    """block_ranges: a packed row of short sequences needs only the blocks its segments touch; the kernel on such
    rows (and on non-contiguous segment ids, causal or not) still equals the reference in values and gradients."""
    seg = np.zeros((2, 64), np.int32)
    seg[0, :8], seg[0, 8:40], seg[0, 40:48] = 1, 2, 3           # row 0: sequences of 8, 32, 8 tokens, padding
    seg[1, :16], seg[1, 16:32] = 1, 2                            # row 1: 16 + 16 tokens, padding
    kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x) for x in block_ranges(jnp.asarray(seg[:1]), 8, True))
    np.testing.assert_array_equal(kv_lo, [0, 1, 1, 1, 1, 5, 6, 7])   # sequence 2 = blocks 1-4; padding: itself
    np.testing.assert_array_equal(kv_hi, np.arange(8))
    np.testing.assert_array_equal(q_lo, np.arange(8))
    np.testing.assert_array_equal(q_hi, [0, 4, 4, 4, 4, 5, 6, 7])
    kv_lo2 = np.asarray(block_ranges(jnp.asarray(seg), 8, True)[0])   # over both rows: the earlier start
    np.testing.assert_array_equal(kv_lo2, [0, 0, 1, 1, 1, 5, 6, 7])   # row 1: block 1 sees block 0
    np.testing.assert_array_equal(np.asarray(block_ranges(jnp.asarray(seg[1:]), 8, False)[1]), [1, 1, 3, 3, 4, 5, 6, 7])
    seg = jnp.asarray(seg)
    q, k, v, w = _inputs(4, 2, seed=3, t=64)
    q, k, v, w = q[:2], k[:2], v[:2], w[:2]
    nc = np.asarray(seg).copy()
    nc[1, 40:48] = 1                                             # row 1: segment 1 again after segment 2
    for s, causal in ((seg, True), (jnp.asarray(nc), True), (jnp.asarray(nc), False)):
        ref_val, ref_out, ref_grads = _value_and_grads("xla", q, k, v, w, s, causal=causal)
        val, out, grads = _value_and_grads("blockwise", q, k, v, w, s, causal=causal, block_size=8)
        real = np.asarray(s) > 0
        assert _rel(out[real], ref_out[real]) <= REL
        for g, r in zip(grads, ref_grads):
            assert float(jnp.max(jnp.abs(r))) > 0.1
            assert _rel(g, r) <= REL


def test_splash_under_shard_map_on_a_mesh_matches_xla():
    """Batch over (data, fsdp) = 4 rows, KV heads over tensor = 2: each device runs the kernel on its shard."""
    seg = _segments()
    q, k, v, w = _inputs(4, 2, seed=3)
    _, ref_out, ref_grads = _value_and_grads("xla", q, k, v, w, seg)
    with jax.set_mesh(make_mesh(data=2, fsdp=2, tensor=2)):
        _, out, grads = jax.jit(lambda q, k, v: _value_and_grads("splash", q, k, v, w, seg, interpret=True))(q, k, v)
    real = np.asarray(seg) > 0
    assert _rel(out[real], ref_out[real]) <= REL
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) <= REL


def test_blockwise_gives_finite_zero_outputs_and_gradients_for_an_all_padding_row():
    q, k, v, w = _inputs(4, 2, t=20)
    seg = jnp.zeros((4, 20), jnp.int32).at[1:].set(1)
    out, grads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(dot_product_attention(q, k, v, seg, implementation="blockwise", block_size=8)),
        (0, 1, 2))(q, k, v)
    o = dot_product_attention(q, k, v, seg, implementation="blockwise", block_size=8)
    assert np.isfinite(float(out)) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert float(jnp.max(jnp.abs(o[0]))) == 0.0 and float(jnp.max(jnp.abs(grads[0][0]))) == 0.0


def test_auto_selection_per_backend_and_dtype_and_cudnn_only_on_gpu():
    bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32
    assert resolve_implementation("auto", bf16, "tpu") == "splash"
    assert resolve_implementation("auto", f32, "tpu") == "splash"
    assert resolve_implementation("auto", bf16, "gpu") == "cudnn"
    assert resolve_implementation("auto", f16, "cuda") == "cudnn"
    assert resolve_implementation("auto", f32, "gpu") == "blockwise"
    assert resolve_implementation("auto", bf16, "cpu") == "blockwise"
    assert resolve_implementation("auto", bf16, "rocm") == "blockwise"
    assert resolve_implementation("cudnn", bf16, "gpu") == "cudnn"
    assert resolve_implementation("xla", f32, "cpu") == "xla"
    with pytest.raises(AttentionError, match="cudnn"):
        resolve_implementation("cudnn", bf16, "cpu")
    with pytest.raises(AttentionError, match="bfloat16/float16"):
        resolve_implementation("cudnn", f32, "gpu")
    with pytest.raises(AttentionError, match="model.attention='flash'"):
        resolve_implementation("flash", f32, "cpu")
    with pytest.raises(ConfigError, match="Qwen3Config.attention='flash'"):
        Qwen3Config(attention="flash")
    if jax.default_backend() == "cpu":
        q, k, v, _ = _inputs(4, 2, t=8)
        with pytest.raises(AttentionError, match="NVIDIA GPU"):
            dot_product_attention(q.astype(bf16), k, v, jnp.ones((4, 8), jnp.int32), implementation="cudnn")
        with pytest.raises(AttentionError, match="runs on TPU"):
            dot_product_attention(q, k, v, jnp.ones((4, 8), jnp.int32), implementation="splash")


def _with_attention(path, attention, block):
    cfg, loaded = load_hf_checkpoint(path)
    model = Qwen3(dataclasses.replace(cfg, attention=attention, attention_block_size=block), rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(loaded))
    return model


def test_blockwise_model_matches_hf_logits_and_packed_rows_match_unpacked(hf_tied):
    hf_model, path = hf_tied
    model = _with_attention(path, "blockwise", 4)       # T = 12: three key blocks
    ids, mask = padded_batch()
    ref = hf_logits(hf_model, ids, mask)
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool))
    ours = np.asarray(model.logits(hidden))
    valid = mask.astype(bool)
    assert np.abs(ref[valid]).max() > 1.0
    assert np.abs(ours[valid] - ref[valid]).max() <= 1e-4
    # rows 1 and 2 packed into one row, positions restarting per sequence: the same logits
    r1, r2 = ids[1, mask[1] == 1], ids[2, mask[2] == 1]
    packed = np.concatenate([r1, r2, np.zeros(3, np.int64)])[None]
    seg = np.concatenate([np.ones(len(r1)), 2 * np.ones(len(r2)), np.zeros(3)]).astype(np.int32)[None]
    pos = np.concatenate([np.arange(len(r1)), np.arange(len(r2)), np.zeros(3)]).astype(np.int32)[None]
    h, _ = model(jnp.asarray(packed, jnp.int32), jnp.asarray(seg > 0), positions=jnp.asarray(pos),
                 segment_ids=jnp.asarray(seg))
    got = np.asarray(model.logits(h))[0]
    assert np.abs(got[:len(r1)] - ref[1][mask[1] == 1]).max() <= 1e-4
    assert np.abs(got[len(r1):len(r1) + len(r2)] - ref[2][mask[2] == 1]).max() <= 1e-4


def test_blockwise_prefill_greedy_decoding_equals_hf_generate(hf_tied):
    hf_model, path = hf_tied
    model = _with_attention(path, "blockwise", 4)
    ids, mask = padded_batch(seed=5, t=8)
    ids, mask = ids[:3], mask[:3]
    with torch.no_grad():
        ref = hf_model.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                                max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0,
                                eos_token_id=None, bos_token_id=None, use_cache=True)[:, 8:].numpy()
    tokens, lengths = greedy_generate(model, ids, mask, 10)
    assert lengths.tolist() == [10, 10, 10]
    assert tokens.tolist() == ref.tolist()
