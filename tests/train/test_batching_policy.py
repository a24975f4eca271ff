"""Packing (verl layout), the policy's response log-probs, and the optimizer schedule."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.train.batching import pack_prompt_response
from stapo_jax.algo.logprobs import logits_to_log_probs_and_entropy
from stapo_jax.train.optim import GlobalNormClipped, clip_by_global_norm, make_optimizer
from stapo_jax.train.policy import response_log_probs_and_entropy


def test_pack_layout_and_errors():
    b = pack_prompt_response([[5, 6, 7], [8]], [[1, 2], []], pad_id=0, pad_multiple=4)
    assert b["input_ids"].tolist() == [[0, 5, 6, 7, 1, 2, 0, 0], [0, 0, 0, 8, 0, 0, 0, 0]]
    assert b["attention_mask"].sum(1).tolist() == [5, 1]
    assert b["response_mask"].tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert b["prompt_lengths"].tolist() == [3, 1] and b["response_lengths"].tolist() == [2, 0]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        pack_prompt_response([[1], []], [[1], [1]], pad_id=0)
    with pytest.raises(ValueError, match="response 0 has 3 tokens > response_length 2"):
        pack_prompt_response([[1]], [[1, 2, 3]], pad_id=0, response_length=2)
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        pack_prompt_response([[1], [2]], [[1]], pad_id=0)


def test_response_log_probs_match_full_logits():
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    m = Qwen3(cfg, rngs=nnx.Rngs(0))
    rng = np.random.RandomState(0)
    b = pack_prompt_response([rng.randint(1, 50, 5).tolist(), rng.randint(1, 50, 2).tolist()],
                             [rng.randint(1, 50, 3).tolist(), rng.randint(1, 50, 6).tolist()], pad_id=0)
    ids, att = jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"])
    R = b["response_mask"].shape[1]
    lp, ent = response_log_probs_and_entropy(m, ids, att, R, temperature=0.7, seq_chunk=3)
    h, _ = m(ids, att)
    logits = m.logits(h)[:, -R - 1:-1]
    lp_ref, ent_ref = logits_to_log_probs_and_entropy(logits, ids[:, -R:], 0.7)
    mask = b["response_mask"]
    np.testing.assert_allclose(np.asarray(lp)[mask], np.asarray(lp_ref)[mask], atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[mask], np.asarray(ent_ref)[mask], atol=1e-5)
    with pytest.raises(ValueError, match="response_length"):
        response_log_probs_and_entropy(m, ids, att, ids.shape[1])


def test_optimizer_warmup_schedule_and_clipping():
    opt = make_optimizer(1e-2, warmup_steps=4, weight_decay=0.0, clip_grad=1.0)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    lrs = []
    for _ in range(6):
        upd, state = opt.update({"w": jnp.full(3, 100.0)}, state, params)
        lrs.append(float(-upd["w"][0]))  # Adam's first step moves by lr * sign(g)
    # lr * min(1, step / warmup): 0, 0.25, 0.5, 0.75, 1, 1 (x lr); Adam normalises the clipped gradient
    np.testing.assert_allclose(lrs, [0, 2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2], rtol=1e-3, atol=1e-9)
    g = optax.clip_by_global_norm(1.0).update({"w": jnp.full(4, 10.0)}, optax.EmptyState())[0]["w"]
    assert float(jnp.linalg.norm(g)) == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(ValueError, match="optim.lr"):
        make_optimizer(0.0)
    with pytest.raises(ValueError, match="clip_grad"):
        make_optimizer(1e-3, clip_grad=0.0)



def test_clip_by_global_norm_multiplies_by_one_factor_like_optax_and_keeps_its_state():
    """Our clip (a scalar factor, fused into the Adam moments by XLA) = optax's clip_by_global_norm: bitwise below
    the threshold, within one rounding above it; the same EmptyState, so AdamW's opt_state tree is unchanged;
    and a few AdamW steps of make_optimizer follow optax's own chain."""
    g = np.random.default_rng(0)
    tree = {"a": jnp.asarray(g.normal(size=(5, 3)), jnp.float32), "b": jnp.asarray(g.normal(size=7), jnp.float32)}
    norm = float(optax.tree.norm(tree))
    for max_norm in (norm * 2, norm / 3):
        ours = clip_by_global_norm(max_norm).update(tree, optax.EmptyState())[0]
        ref = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())[0]
        for k in tree:
            if max_norm > norm:
                np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(tree[k]))
            np.testing.assert_allclose(np.asarray(ours[k]), np.asarray(ref[k]), rtol=1e-6)
    assert float(optax.tree.norm(ours)) == pytest.approx(norm / 3, rel=1e-6)
    opt = make_optimizer(1e-2, warmup_steps=2, weight_decay=0.1, clip_grad=0.5)
    ref_opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(optax.linear_schedule(0.0, 1e-2, 2),
                                                                        weight_decay=0.1))
    p, rp = tree, tree
    s, rs = opt.init(p), ref_opt.init(rp)
    assert jax.tree.structure(s) == jax.tree.structure(rs)
    for step in range(4):
        grads = jax.tree.map(lambda x: x * (step + 1.0) + 0.5, p)
        u, s = opt.update(grads, s, p)
        ru, rs = ref_opt.update(jax.tree.map(lambda x: x * (step + 1.0) + 0.5, rp), rs, rp)
        p, rp = optax.apply_updates(p, u), optax.apply_updates(rp, ru)
    for k in tree:
        assert float(jnp.max(jnp.abs(p[k] - tree[k]))) > 1e-3              # it moved
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(rp[k]), rtol=1e-5, atol=1e-7)


def test_clip_uses_the_global_norm_it_is_given_through_make_optimizers_chain():
    """``global_norm=`` (what the train step passes, the norm it already computed) replaces the clip's own norm:
    the same norm gives bitwise the same update; another norm (3x) scales the clipped update by 1/3; a norm below
    the threshold leaves the gradient unclipped; and make_optimizer's chain forwards it to the clip."""
    g = np.random.default_rng(1)
    tree = {"a": jnp.asarray(g.normal(size=(4, 6)), jnp.float32), "b": jnp.asarray(g.normal(size=5), jnp.float32)}
    norm = optax.tree.norm(tree)
    clip = clip_by_global_norm(float(norm) / 2)
    own = clip.update(tree, optax.EmptyState())[0]
    given = clip.update(tree, optax.EmptyState(), global_norm=norm)[0]
    tripled = clip.update(tree, optax.EmptyState(), global_norm=norm * 3)[0]
    below = clip.update(tree, optax.EmptyState(), global_norm=norm / 4)[0]
    for k in tree:
        np.testing.assert_array_equal(np.asarray(given[k]), np.asarray(own[k]))
        np.testing.assert_allclose(np.asarray(tripled[k]), np.asarray(own[k]) / 3, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(below[k]), np.asarray(tree[k]))
    opt = make_optimizer(1e-2, weight_decay=0.0, clip_grad=float(norm) / 2)
    assert isinstance(opt, GlobalNormClipped) and not isinstance(make_optimizer(1e-2), GlobalNormClipped)
    s = opt.init(tree)
    u_own = opt.update(tree, s, tree)[0]
    u_given = opt.update(tree, s, tree, global_norm=norm)[0]
    u_other = opt.update(tree, s, tree, global_norm=norm * 1e6)[0]  # a wrong norm changes the first Adam step
    for k in tree:
        np.testing.assert_array_equal(np.asarray(u_given[k]), np.asarray(u_own[k]))
    assert float(jnp.max(jnp.abs(u_other["a"] - u_own["a"]))) > 1e-4
