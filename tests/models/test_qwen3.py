"""Model-internal properties of models/qwen3.py that need no HF side: padding invariance, cache/remat/dtype
policies, config parsing. HF parity lives in tests/models/test_hf.py."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.decode import decode_step, prefill, split_layers
from models.qwen3 import Qwen3, param_count
from models.qwen3_config import Qwen3Config
from models.kv_cache import init_cache
from models.qwen3_layers import remat_layer
from stapo_jax.core.errors import ConfigError

TINY = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                   tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model():
    return Qwen3(TINY, rngs=nnx.Rngs(1))


def _logits(model, ids, mask):
    h, _ = model(jnp.asarray(ids), jnp.asarray(mask))
    return np.asarray(model.logits(h))


def test_left_and_right_padding_do_not_change_real_tokens(model):
    rng = np.random.RandomState(0)
    seq = rng.randint(0, 97, (1, 7))
    base = _logits(model, seq, np.ones((1, 7), int))
    left = np.concatenate([np.full((1, 5), 3), seq], 1)
    lmask = np.concatenate([np.zeros((1, 5), int), np.ones((1, 7), int)], 1)
    right = np.concatenate([seq, np.full((1, 4), 0)], 1)
    rmask = np.concatenate([np.ones((1, 7), int), np.zeros((1, 4), int)], 1)
    np.testing.assert_allclose(_logits(model, left, lmask)[:, 5:], base, atol=1e-5)
    np.testing.assert_allclose(_logits(model, right, rmask)[:, :7], base, atol=1e-5)
    # pad ids inside the padding do not matter either, and fully masked rows stay finite
    left2 = left.copy(); left2[0, :5] = 50
    np.testing.assert_allclose(_logits(model, left2, lmask)[:, 5:], base, atol=1e-5)
    assert np.isfinite(_logits(model, left, np.zeros_like(lmask))).all()


def test_batch_rows_are_independent(model):
    rng = np.random.RandomState(1)
    ids = rng.randint(0, 97, (3, 6))
    alone = _logits(model, ids[1:2], np.ones((1, 6), int))
    together = _logits(model, ids, np.ones((3, 6), int))
    np.testing.assert_allclose(together[1:2], alone, atol=1e-5)


def test_prefill_then_decode_equals_full_forward_with_ragged_left_padding(model):
    rng = np.random.RandomState(2)
    ids = rng.randint(0, 97, (2, 12))
    mask = np.ones((2, 12), int); mask[0, :4] = 0
    full = _logits(model, ids, mask)
    graphdef, state = nnx.split(model)
    cache = init_cache(TINY, 2, 16)
    logits, cache = prefill(graphdef, state, jnp.asarray(ids[:, :8]), jnp.asarray(mask[:, :8]), cache)
    np.testing.assert_allclose(np.asarray(logits), full[:, 7], atol=1e-5)
    for t in range(8, 12):
        logits, cache = decode_step(graphdef, state, jnp.asarray(ids[:, t]), cache)
        np.testing.assert_allclose(np.asarray(logits), full[:, t], atol=1e-5)
    assert np.asarray(cache.length).tolist() == [12, 12]
    assert np.asarray(cache.next_position).tolist() == [8, 12]
    # the per-layer parameter layout the rollout engine uses (DecodeParams) gives the same logits and cache
    split = split_layers(state)
    cache2 = init_cache(TINY, 2, 16)
    logits2, cache2 = prefill(graphdef, split, jnp.asarray(ids[:, :8]), jnp.asarray(mask[:, :8]), cache2)
    np.testing.assert_allclose(np.asarray(logits2), full[:, 7], atol=1e-5)
    for t in range(8, 12):
        logits2, cache2 = decode_step(graphdef, split, jnp.asarray(ids[:, t]), cache2)
    np.testing.assert_allclose(np.asarray(logits2), np.asarray(logits), atol=1e-6)
    assert len(cache2.k) == TINY.num_hidden_layers and cache2.k[0].shape == (2, TINY.num_key_value_heads, 16,
                                                                             TINY.head_dim)
    for a, b in zip(cache.k + cache.v, cache2.k + cache2.v):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_cached_call_rejects_mismatched_cache_and_layers(model):
    ids, mask = jnp.ones((2, 3), jnp.int32), jnp.ones((2, 3), bool)
    short = init_cache(dataclasses.replace(TINY, num_hidden_layers=TINY.num_hidden_layers - 1), 2, 8)
    with pytest.raises(ValueError, match="layers"):
        model(ids, mask, cache=short)
    with pytest.raises(ValueError, match="rows"):
        model(ids, mask, cache=init_cache(TINY, 3, 8))
    layers = split_layers(nnx.split(model)[1]).layers
    with pytest.raises(ValueError, match="only used together with a cache"):
        model(ids, mask, layers=layers)
    with pytest.raises(ValueError, match="layers has 1 entries"):
        model(ids, mask, cache=init_cache(TINY, 2, 8), layers=layers[:1])


def test_remat_and_bf16_policies():
    rng = np.random.RandomState(3)
    ids = jnp.asarray(rng.randint(0, 97, (2, 5))); mask = jnp.ones((2, 5), bool)
    ref = Qwen3(TINY, rngs=nnx.Rngs(0))
    base = _logits(ref, ids, mask)
    w = jnp.asarray(rng.standard_normal((2, 5, TINY.vocab_size)), jnp.float32)

    def loss_and_grad(m):
        def loss(state, gd=nnx.graphdef(m)):
            mm = nnx.merge(gd, state)
            h, _ = mm(ids, mask)
            return jnp.sum(jax.nn.log_softmax(mm.logits(h)) * w)
        return loss, jax.value_and_grad(loss)(nnx.state(m))

    _, (l_ref, g_ref) = loss_and_grad(ref)
    for policy in ("none", "full", "dots", "dots_no_batch"):
        m = Qwen3(dataclasses.replace(TINY, remat=policy), rngs=nnx.Rngs(0))
        np.testing.assert_allclose(_logits(m, ids, mask), base, atol=1e-6)
        loss, (l, g) = loss_and_grad(m)  # same loss and gradient under every policy (fp32)
        np.testing.assert_allclose(l, l_ref, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))  # fp32 rounding
        # the policy is applied: the layer scan body holds a jax.checkpoint (`remat2`) equation with that policy
        eqns = [e for e in jax.make_jaxpr(loss)(nnx.state(m)).jaxpr.eqns if e.primitive.name == "scan"]
        inner = [e.primitive.name for e in eqns[0].params["jaxpr"].jaxpr.eqns]
        assert ("remat2" in inner) == (policy != "none"), (policy, inner)  # jax.checkpoint's primitive
        if policy != "none":
            ck = next(e for e in eqns[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "remat2")
            expect = {"full": None, "dots": jax.checkpoint_policies.checkpoint_dots,
                      "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[policy]
            assert ck.params["policy"] is expect
    bf = Qwen3(dataclasses.replace(TINY, dtype="bfloat16", param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(bf, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(ref, nnx.Param)))
    h, _ = bf(ids, mask)
    assert h.dtype == jnp.bfloat16
    assert jax.tree.leaves(nnx.state(bf, nnx.Param))[0].dtype == jnp.bfloat16
    lb = np.asarray(bf.logits(h))
    assert lb.dtype == np.float32
    assert np.abs(lb - base).max() < 0.05  # bf16 rounding of weights and activations only


@pytest.mark.parametrize("unroll", [2, 3])
def test_scan_unroll_gives_the_rolled_loss_and_gradient(unroll):
    """``Qwen3Config.scan_unroll`` (``jax.lax.scan(unroll=)``): 3 layers run 2 or 3 per loop iteration (a
    remainder iteration for 2) with the same loss and gradient as the rolled scan, and the traced scan carries
    that unroll; bad values are refused naming the field. ``resolve_scan_unroll``: ``auto`` is
    ``CPU_SCAN_UNROLL`` on CPU and 1 on GPU / TPU, ints pass through, anything else is named."""
    from models.layer_scan import CPU_SCAN_UNROLL, resolve_scan_unroll

    cfg = dataclasses.replace(TINY, num_hidden_layers=3, remat="dots_no_batch")
    rng = np.random.RandomState(5)
    ids = jnp.asarray(rng.randint(0, 97, (2, 6))); mask = jnp.asarray(rng.rand(2, 6) > 0.2)

    def value_and_grad(c):
        m = Qwen3(c, rngs=nnx.Rngs(0))
        gd = nnx.graphdef(m)

        def loss(state):
            mm = nnx.merge(gd, state)
            return jnp.mean(jax.nn.log_softmax(mm.logits(mm(ids, mask)[0]))[..., 7])
        scans = [e for e in jax.make_jaxpr(loss)(nnx.state(m)).jaxpr.eqns if e.primitive.name == "scan"]
        return jax.value_and_grad(loss)(nnx.state(m)), scans[0].params["unroll"]

    (l_ref, g_ref), rolled = value_and_grad(cfg)
    (l, g), unrolled = value_and_grad(dataclasses.replace(cfg, scan_unroll=unroll))
    assert (rolled, unrolled) == (1, unroll)
    np.testing.assert_allclose(l, l_ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="scan_unroll"):
            dataclasses.replace(cfg, scan_unroll=bad)
        with pytest.raises(ValueError, match="scan_unroll"):
            resolve_scan_unroll(bad, "cpu")
    assert (resolve_scan_unroll("auto", "cpu"), resolve_scan_unroll("auto", "gpu"),
            resolve_scan_unroll("auto", "tpu"), resolve_scan_unroll(unroll, "tpu")) == (CPU_SCAN_UNROLL, 1, 1, unroll)
    with pytest.raises(ValueError, match="scan_unroll must be 'auto' or an int"):
        resolve_scan_unroll("fast")


def test_remat_layer_wraps_only_when_asked_and_names_an_unknown_policy():
    def step(x):
        return jnp.sin(x) @ x

    assert remat_layer(step, "none") is step
    x = jnp.arange(4.0).reshape(2, 2) / 4
    for policy in ("full", "dots", "dots_no_batch"):
        wrapped = remat_layer(step, policy)
        assert wrapped is not step
        np.testing.assert_array_equal(wrapped(x), step(x))
        names = [e.primitive.name for e in jax.make_jaxpr(wrapped)(x).jaxpr.eqns]
        assert names == ["remat2"], (policy, names)
    with pytest.raises(KeyError, match="remat='dot'"):
        remat_layer(step, "dot")


def test_config_reads_both_rope_forms_and_rejects_non_qwen3():
    d = TINY.to_hf_dict()
    assert Qwen3Config.from_hf_dict(d).rope_theta == 10000.0
    d5 = dict(d); d5.pop("rope_theta"); d5["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    assert Qwen3Config.from_hf_dict(d5).rope_theta == 5e5
    with pytest.raises(ConfigError, match="not a Qwen3 config"):
        Qwen3Config.from_hf_dict({**d, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="RoPE scaling"):
        Qwen3Config.from_hf_dict({**d, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        dataclasses.replace(TINY, num_key_value_heads=3)


def test_param_count_tiny_matches_formula():
    c = TINY
    per_layer = (2 * c.hidden_size + 2 * c.head_dim
                 + c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
                 + 3 * c.hidden_size * c.intermediate_size)
    expect = c.vocab_size * c.hidden_size + c.num_hidden_layers * per_layer + c.hidden_size
    assert param_count(c) == expect
    assert param_count(dataclasses.replace(c, tie_word_embeddings=False)) == expect + c.vocab_size * c.hidden_size


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_write_rows_updates_a_donated_cache_in_place(dtype):
    """Per-row KV-cache writes land at each row's index and, for a 16-bit cache too, need no temporary copy of
    the cache (XLA:CPU converts a bfloat16 dynamic-update-slice operand to float32: 2x the cache)."""
    from models.kv_cache import write_rows

    cache = jnp.asarray(np.random.default_rng(0).normal(size=(4, 2, 2048, 64)), dtype)
    upd = jnp.asarray(np.random.default_rng(1).normal(size=(4, 2, 1, 64)), jnp.float32)
    idx = jnp.asarray([0, 5, 2047, 17], jnp.int32)
    expected = np.asarray(cache.astype(jnp.float32)).copy()
    for b, i in enumerate(np.asarray(idx)):
        expected[b, :, i] = np.asarray(upd[b, :, 0].astype(dtype).astype(jnp.float32))
    f = jax.jit(write_rows, donate_argnums=0)
    mem = f.lower(cache, upd, idx).compile().memory_analysis()
    assert mem.temp_size_in_bytes < cache.nbytes / 8, (mem.temp_size_in_bytes, cache.nbytes)
    assert mem.alias_size_in_bytes >= cache.nbytes
    out = f(cache, upd, idx)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)
