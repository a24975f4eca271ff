"""Parity of the full loss (log-probs -> mask -> clipped surrogate -> aggregation) with the PyTorch reference.

For every recipe x aggregation mode, on random logits with ragged response masks (one empty row, one constant-
reward group), the loss value and its gradient w.r.t. the logits agree with tests/torch_reference.py within
1e-10 in float64 and 1e-5 in float32. Plus KL / entropy-bonus / renormalize variants, dual-clip edge cases,
and hypothesis properties (empty batches give 0 loss and 0 gradient, never NaN).
"""

import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import torch_reference as ref  # noqa: E402

from stapo_jax.algo.advantages import grpo_advantages  # noqa: E402
from stapo_jax.algo.logprobs import logits_to_log_probs_and_entropy  # noqa: E402
from stapo_jax.algo.objectives import (  # noqa: E402
    CONSTANT_DENOMINATOR_MODES,
    LOSS_AGG_MODES,
    PolicyLossConfig,
    PolicyLossInputs,
    aggregate,
    compute_policy_loss,
    finalize_metrics,
    kl_loss,
    kl_penalty,
    safe_divide,
)
from stapo_jax.algo.recipes import compute_token_mask  # noqa: E402
from stapo_jax.config.recipes import RECIPES, get_recipe  # noqa: E402

B, T, V, G = 6, 9, 11, 3
TEMP = 0.9


def make_inputs(seed: int):
    """Random float64 numpy inputs: peaked logits (so some sampled tokens have p < 0.002), ragged masks."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(B, T, V)) * 4.0
    ids = rng.integers(0, V, size=(B, T))
    lengths = rng.integers(1, T + 1, size=B)
    lengths[2] = 0  # one empty response
    resp = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    rewards = rng.choice([-1.0, 1.0], size=B)
    rewards[3:] = 1.0  # second group constant -> zero advantage
    rewards[0], rewards[1] = 1.0, -1.0
    groups = np.repeat(np.arange(B // G), G)
    # old log-probs near the current ones so ratios straddle both clip boundaries
    lp = ref.to_numpy(ref.logprobs_from_logits(torch.from_numpy(logits), torch.from_numpy(ids), TEMP))
    old = lp + rng.normal(size=(B, T)) * 0.4
    old[1, :2] = lp[1, :2] - 3.0  # ratio e^3 ~ 20 > c = 10 on a negative-advantage row: dual clip active
    ref_lp = lp + rng.normal(size=(B, T)) * 0.3
    return dict(logits=logits, ids=ids, resp=resp, rewards=rewards, groups=groups, old=old, ref_lp=ref_lp)


def jax_loss_and_grad(inp, recipe, dtype):
    logits = jnp.asarray(inp["logits"], dtype)
    ids = jnp.asarray(inp["ids"])
    resp = jnp.asarray(inp["resp"], dtype)
    adv = grpo_advantages(jnp.asarray(inp["rewards"], dtype), jnp.asarray(inp["groups"]))
    old = jnp.asarray(inp["old"], dtype)
    ref_lp = jnp.asarray(inp["ref_lp"], dtype)

    def loss_fn(logits):
        lp, ent = logits_to_log_probs_and_entropy(logits, ids, TEMP)
        keep, _ = compute_token_mask(recipe, log_probs=lp, entropy=ent, advantages=adv, response_mask=resp)
        s, d, m = compute_policy_loss(PolicyLossInputs(old, lp, adv, resp, keep, entropy=ent,
                                                       ref_log_probs=ref_lp if recipe.loss.use_kl_loss else None,
                                                       renormalize=recipe.renormalize), recipe.loss)
        return safe_divide(s, d), (keep, m, d)

    (loss, (keep, metrics, den)), grad = jax.value_and_grad(loss_fn, has_aux=True)(logits)
    return loss, grad, keep, finalize_metrics(metrics, den)


def torch_loss_and_grad(inp, recipe, dtype):
    logits = torch.tensor(inp["logits"], dtype=dtype, requires_grad=True)
    rewards = torch.tensor(inp["rewards"], dtype=dtype)
    adv = ref.grpo_advantage(rewards, list(inp["groups"]))
    c, s2t, te = recipe.loss, recipe.s2t, recipe.top_entropy
    loss, keep, metrics = ref.recipe_loss(
        logits, torch.tensor(inp["ids"]), torch.tensor(inp["old"], dtype=dtype), adv,
        torch.tensor(inp["resp"], dtype=dtype), temperature=TEMP, clip_ratio_low=c.clip_ratio_low,
        clip_ratio_high=c.clip_ratio_high, clip_ratio_c=c.clip_ratio_c, loss_agg_mode=c.loss_agg_mode,
        token_mask=recipe.token_mask, tau_p=s2t.tau_p, entropy_quantile=s2t.entropy_quantile,
        quantile_method=s2t.quantile_method, top_ratio=te.ratio, renormalize=recipe.renormalize,
        entropy_coeff=c.entropy_coeff, ref_log_prob=torch.tensor(inp["ref_lp"], dtype=dtype),
        kl_loss_coef=c.kl_loss_coef if c.use_kl_loss else 0.0, kl_loss_type=c.kl_loss_type,
        loss_scale_factor=c.loss_scale_factor)
    loss.backward()
    return loss.item(), logits.grad.numpy(), keep.numpy(), {k: v.item() for k, v in metrics.items()}


def check_parity(recipe, seed=0):
    inp = make_inputs(seed)
    # float64: 1e-10
    with jax.enable_x64(True):
        l64, g64, keep64, m64 = jax_loss_and_grad(inp, recipe, jnp.float64)
        l64, g64, keep64 = float(l64), np.asarray(g64), np.asarray(keep64)
        m64 = {k: float(v) for k, v in m64.items()}
    tl, tg, tkeep, tm = torch_loss_and_grad(inp, recipe, torch.float64)
    if recipe.token_mask != "none":
        np.testing.assert_array_equal(keep64, tkeep)
    assert abs(l64 - tl) <= 1e-10, (l64, tl)
    np.testing.assert_allclose(g64, tg, rtol=0, atol=1e-10)
    for name in ("pg_clipfrac", "ppo_kl", "ratio_mean", "pg_clipfrac_lower"):
        if name in tm:
            assert abs(m64[name] - tm[name]) <= 1e-10, (name, m64[name], tm[name])
    # float32: 1e-5
    l32, g32, _, _ = jax_loss_and_grad(inp, recipe, jnp.float32)
    tl32, tg32, _, _ = torch_loss_and_grad(inp, recipe, torch.float32)
    assert abs(float(l32) - tl32) <= 1e-5, (float(l32), tl32)
    np.testing.assert_allclose(np.asarray(g32), tg32, rtol=0, atol=1e-5)
    assert np.abs(tg).sum() > 0  # non-trivial gradient
    if recipe.loss.clip_ratio_c is not None:
        assert tm["pg_clipfrac_lower"] > 0  # the fixture exercises the dual clip
    return keep64, inp


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_parity_with_torch(name, mode):
    recipe = get_recipe(name, loss={"loss_agg_mode": mode})
    keep, inp = check_parity(recipe)
    if name == "stapo":  # the S2T mask must actually silence tokens in this fixture
        assert (inp["resp"].astype(bool) & ~keep).sum() > 0
    if name == "entropy20":
        assert keep.sum() == max(1, int(inp["resp"].sum() * 0.2 + 0.9999))


@pytest.mark.parametrize(
    "changes",
    [
        dict(loss={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "entropy_coeff": 0.01}),
        dict(loss={"use_kl_loss": True, "kl_loss_coef": 0.04, "kl_loss_type": "kl",
                   "loss_agg_mode": "seq-mean-token-mean"}),
        dict(loss={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k2", "clip_ratio_c": None}),
        dict(loss={"use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k3+", "loss_scale_factor": 4.0,
                   "loss_agg_mode": "seq-mean-token-sum-norm"}),
        dict(s2t={"renormalize": False}, loss={"entropy_coeff": 0.02}),
        dict(s2t={"renormalize": False, "quantile_method": "nearest"}, loss={"loss_agg_mode": "seq-mean-token-sum"}),
        dict(s2t={"quantile_method": "topk_ceil", "entropy_quantile": 0.2}),
    ],
)
def test_variant_parity_with_torch(changes):
    check_parity(get_recipe("stapo", **changes), seed=1)


def test_kl_estimators_match_torch():
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=50) * 3, rng.normal(size=50) * 3
    with jax.enable_x64(True):
        for kind in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "abs+"):
            ours = jax.value_and_grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(b), kind) * jnp.arange(50.0)))(
                jnp.asarray(a))
            ta = torch.tensor(a, requires_grad=True)
            tv = (ref.kl_penalty(ta, torch.tensor(b), kind) * torch.arange(50.0, dtype=torch.float64)).sum()
            tv.backward()
            assert abs(float(ours[0]) - tv.item()) < 1e-10, kind
            np.testing.assert_allclose(np.asarray(ours[1]), ta.grad.numpy(), atol=1e-10, err_msg=kind)


def test_dual_clip_and_clip_boundaries_by_hand():
    # A < 0 and a huge ratio: loss capped at -c * A = 10 * 2 = 20 (dual clip), gradient 0.
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    lp = jnp.array([[jnp.log(50.0), jnp.log(1.5), jnp.log(0.5), jnp.log(1.1)]])
    old = jnp.zeros((1, 4))
    adv = jnp.array([[-2.0, 1.0, -1.0, 1.0]])
    mask = jnp.ones((1, 4))
    s, d, m = compute_policy_loss(PolicyLossInputs(old, lp, adv, mask), cfg)
    # tokens: dual clip 20; A>0, r=1.5 -> clipped at 1.28 -> -1.28; A<0, r=0.5 -> max(0.5, 0.8) = 0.8; -1.1
    np.testing.assert_allclose(float(s), 20.0 - 1.28 + 0.8 - 1.1, rtol=1e-6)
    assert float(d) == 4.0
    fm = finalize_metrics(m)
    np.testing.assert_allclose(float(fm["pg_clipfrac"]), 2 / 4)  # tokens 1 and 2 clipped
    np.testing.assert_allclose(float(fm["pg_clipfrac_lower"]), 1 / 4)
    g = jax.grad(lambda x: compute_policy_loss(PolicyLossInputs(old, x, adv, mask), cfg)[0])(lp)
    np.testing.assert_allclose(np.asarray(g), [[0.0, 0.0, 0.0, -1.1]], rtol=1e-6)
    # log-ratio clamp at 20: no overflow, zero gradient beyond it
    g = jax.grad(lambda x: compute_policy_loss(PolicyLossInputs(old, x, adv, mask), cfg)[0])(jnp.full((1, 4), 30.0))
    assert np.all(np.isfinite(np.asarray(g)))


def test_aggregation_values_by_hand():
    L = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    M = jnp.array([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert tuple(map(float, aggregate(L, M, M, "token-mean"))) == (10.0, 4.0)
    s, d = aggregate(L, M, M, "seq-mean-token-mean")
    np.testing.assert_allclose([float(s), float(d)], [6 / (3 + 1e-8) + 4 / (1 + 1e-8), 2.0])
    assert tuple(map(float, aggregate(L, M, M, "seq-mean-token-sum"))) == (10.0, 2.0)
    assert tuple(map(float, aggregate(L, M, M, "seq-mean-token-sum-norm"))) == (10.0, 2.0 * 3.0)  # verl 0.9.1
    assert tuple(map(float, aggregate(L, M, M, "seq-mean-token-sum-norm", 7.0))) == (10.0, 2.0 * 7.0)
    assert tuple(map(float, aggregate(L, M, M, "token-sum-norm"))) == (10.0, 3.0)  # verl < 0.9.1
    assert tuple(map(float, aggregate(L, M, M, "token-sum-norm", 7.0))) == (10.0, 7.0)
    assert tuple(map(float, aggregate(L, M, M, "token-sum"))) == (10.0, 1.0)


def test_inputs_bundle_is_a_pytree_with_static_flags():
    """PolicyLossInputs is one pytree argument: its arrays are leaves (None ones absent), its flags static, so a
    jitted loss of the bundle equals the eager one and a changed flag gives a different program's result."""
    rng = np.random.default_rng(5)
    lp, old = (jnp.asarray(rng.normal(size=(2, 4)) - 2.0, jnp.float32) for _ in range(2))
    resp = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]], jnp.float32)
    inputs = PolicyLossInputs(old, lp, jnp.asarray([1.0, -0.5]), resp, return_per_token=True)
    leaves, treedef = jax.tree.flatten(inputs)
    assert len(leaves) == 4 and jax.tree.unflatten(treedef, leaves).return_per_token is True
    cfg = PolicyLossConfig()
    eager, jitted = compute_policy_loss(inputs, cfg), jax.jit(compute_policy_loss, static_argnums=1)(inputs, cfg)
    assert len(jitted) == 4  # return_per_token travelled as static metadata
    np.testing.assert_array_equal(np.asarray(eager[0]), np.asarray(jitted[0]))
    np.testing.assert_array_equal(np.asarray(eager[3]["ratio"]), np.asarray(jitted[3]["ratio"]))
    folded = jax.jit(compute_policy_loss, static_argnums=1)(dataclasses.replace(inputs, return_per_token=False), cfg)
    assert len(folded) == 3 and float(folded[0]) == float(eager[0])


def test_bad_inputs_name_the_field():
    x = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_loss(PolicyLossInputs(jnp.zeros((2, 4)), x, jnp.zeros(2), x))
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss(PolicyLossInputs(x, x, jnp.zeros(3), x))
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_policy_loss(PolicyLossInputs(x, x, jnp.zeros(2), x), PolicyLossConfig(use_kl_loss=True))
    with pytest.raises(ValueError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=0.5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        PolicyLossConfig(loss_agg_mode="mean")
    xi = jnp.zeros((2, 3), jnp.int32)  # an int dtype would have truncated the other inputs to ints
    for args, name in (((x, xi, jnp.zeros(2), x), "log_probs"), ((xi, x, jnp.zeros(2), x), "old_log_probs"),
                       ((x, x, jnp.zeros(2, jnp.int32), x), "advantages")):
        with pytest.raises(ValueError, match=f"^{name} must be a float array, got dtype int32"):
            compute_policy_loss(PolicyLossInputs(*args))
    with pytest.raises(TypeError, match="takes \\(inputs: PolicyLossInputs, config\\), got inputs of type"):
        compute_policy_loss(x)  # the bundle, not the arrays


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_response_mask_is_read_as_a_boolean(mode):
    """A response_mask holding 2 (or 0.5) marks one token, as 1 does: the loss, its gradient and every metric
    equal the 0/1 mask's, in every aggregation mode (a weight of 2 would count the token twice)."""
    rng = np.random.default_rng(3)
    lp = jnp.asarray(rng.normal(size=(3, 5)) - 2.0, jnp.float32)
    old = jnp.asarray(rng.normal(size=(3, 5)) - 2.0, jnp.float32)
    adv = jnp.asarray(rng.normal(size=3), jnp.float32)
    ones = (np.arange(5)[None] < np.array([[5], [2], [4]])).astype(np.float32)
    cfg = PolicyLossConfig(loss_agg_mode=mode, use_kl_loss=True)
    ref_lp = lp - 0.1

    def run(mask):
        def f(x):
            s, d, _ = compute_policy_loss(PolicyLossInputs(old, x, adv, jnp.asarray(mask), ref_log_probs=ref_lp), cfg)
            return s / d
        value, grad = jax.value_and_grad(f)(lp)
        metrics = compute_policy_loss(PolicyLossInputs(old, lp, adv, jnp.asarray(mask), ref_log_probs=ref_lp), cfg)[2]
        return float(value), np.asarray(grad), {k: float(a) / float(b) for k, (a, b) in metrics.items()}

    want = run(ones)
    odd = ones * np.where(rng.random((3, 5)) < 0.5, 2.0, 0.5).astype(np.float32)
    got = run(odd)
    assert got[0] == want[0] and want[0] != 0.0
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] == want[2]


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(LOSS_AGG_MODES), b=st.integers(1, 4), t=st.integers(1, 5),
       seed=st.integers(0, 2**16), empty=st.sampled_from(["response", "token"]))
def test_all_masked_gives_zero_loss_and_zero_grad(mode, b, t, seed, empty):
    rng = np.random.default_rng(seed)
    lp = jnp.asarray(rng.normal(size=(b, t)) - 2.0, jnp.float32)
    old = jnp.asarray(rng.normal(size=(b, t)) - 2.0, jnp.float32)
    adv = jnp.asarray(rng.normal(size=b), jnp.float32)
    resp = jnp.zeros((b, t)) if empty == "response" else jnp.ones((b, t))
    keep = jnp.zeros((b, t), bool)
    # the KL term covers every valid token whatever the token mask (test_kl_term_ignores_the_token_mask), so it
    # is part of this all-zero claim only when no token is valid
    cfg = PolicyLossConfig(loss_agg_mode=mode, use_kl_loss=empty == "response", entropy_coeff=0.1)

    def f(x):
        s, d, _ = compute_policy_loss(PolicyLossInputs(old, x, adv, resp, keep, entropy=-x, ref_log_probs=old), cfg)
        return safe_divide(s, d)

    # jitted (as in the update step): one compile per example instead of one per operation
    val, g = jax.jit(jax.value_and_grad(f))(lp)
    assert float(val) == 0.0
    assert np.all(np.asarray(g) == 0.0)
    s, d, m = jax.jit(lambda x: compute_policy_loss(PolicyLossInputs(old, x, adv, resp, keep, entropy=-x,
                                                                     ref_log_probs=old), cfg))(lp)
    for v in finalize_metrics(m).values():
        assert np.isfinite(float(v))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["stapo", "entropy20", "grpo"])
def test_micro_batch_accumulation_is_exact(name, mode):
    """sum_k loss_sum_k / D (D = sum_k denominators, or the constant for sum-norm) and its gradient equal the
    full-batch loss, with micro-batches of unequal response lengths and the mask taken over the mini-batch."""
    recipe = get_recipe(name, loss={"loss_agg_mode": mode, "loss_scale_factor": 5.0})
    inp = make_inputs(4)
    logits = jnp.asarray(inp["logits"], jnp.float32)
    ids, resp, old = jnp.asarray(inp["ids"]), jnp.asarray(inp["resp"], jnp.float32), jnp.asarray(inp["old"],
                                                                                                  jnp.float32)
    adv = grpo_advantages(jnp.asarray(inp["rewards"], jnp.float32), jnp.asarray(inp["groups"]))
    lp0, ent0 = logits_to_log_probs_and_entropy(logits, ids, TEMP)
    keep, _ = compute_token_mask(recipe, log_probs=lp0, entropy=ent0, advantages=adv, response_mask=resp)

    def parts(z, rows):
        lp, ent = logits_to_log_probs_and_entropy(z[rows], ids[rows], TEMP)
        return compute_policy_loss(PolicyLossInputs(old[rows], lp, adv[rows], resp[rows],
                                                    None if keep is None else keep[rows], entropy=ent,
                                                    renormalize=recipe.renormalize), recipe.loss)[:2]

    def full(z):
        s, d = parts(z, np.arange(B))
        return safe_divide(s, d)

    splits = [np.array([0, 3]), np.array([1]), np.array([2, 4, 5])]  # unequal micro-batches

    def accumulated(z):
        ss, ds = zip(*(parts(z, r) for r in splits))
        den = ds[0] if mode in CONSTANT_DENOMINATOR_MODES else sum(ds)
        return safe_divide(sum(ss), den)

    v1, g1 = jax.value_and_grad(full)(logits)
    v2, g2 = jax.value_and_grad(accumulated)(logits)
    assert abs(float(v1) - float(v2)) < 1e-6 and float(v1) != 0.0
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), atol=1e-7)


def test_per_token_outputs_and_standalone_kl():
    """return_per_token gives the terms a loss unit test wants, consistent with the aggregate; kl_loss equals the
    kl_loss metric."""
    lp = jnp.array([[-1.0, -0.5, -2.0, 0.0], [-0.3, -1.0, -1.0, -1.0]])
    old = jnp.array([[-1.5, -0.5, -0.2, 0.0], [-0.3, -25.0, -1.0, -1.0]])
    ref_lp = jnp.array([[-1.2, -0.7, -2.0, 0.0], [-0.1, -1.1, -1.0, -1.0]])
    adv = jnp.array([1.0, -2.0])
    resp = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, use_kl_loss=True,
                           kl_loss_coef=0.1, kl_loss_type="k3")
    s, d, m, pt = compute_policy_loss(PolicyLossInputs(old, lp, adv, resp, ref_log_probs=ref_lp,
                                                       return_per_token=True), cfg)
    np.testing.assert_allclose(np.asarray(pt["log_ratio"]), [[0.5, 0.0, -1.8, 0.0], [0.0, 20.0, 0.0, 0.0]],
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pt["ratio"]), np.where(np.asarray(resp) > 0,
                                                                 np.exp(np.asarray(pt["log_ratio"])), 0), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(pt["clipped"]), [[True, False, False, False], [False, False, False, False]])
    np.testing.assert_array_equal(np.asarray(pt["clipped_lower"]),
                                  [[False, False, False, False], [False, True, False, False]])
    assert float(pt["pg_losses"][1, 1]) == pytest.approx(6.0)  # dual clip: -A c = 2 * 3
    assert float(pt["pg_losses"][0, 0]) == pytest.approx(-1.28, rel=1e-6)
    np.testing.assert_allclose(float(jnp.sum(pt["loss"])), float(s), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pt["loss"]), np.asarray(pt["pg_losses"] + 0.1 * pt["kl"]), rtol=1e-6)
    ks, kd = kl_loss(lp, ref_lp, resp, kl_loss_type="k3")
    np.testing.assert_allclose(float(ks) / float(kd), float(m["kl_loss"][0]) / float(m["kl_loss"][1]), rtol=1e-6)
    np.testing.assert_allclose(float(ks), float(jnp.sum(pt["kl"])), rtol=1e-6)


def test_truncated_sampler_importance_weight_by_hand():
    """sampler_is=truncate multiplies each token's surrogate by min(exp(old - rollout), sampler_is_cap)."""
    lp, old, roll = jnp.array([[-1.0, -0.5]]), jnp.array([[-1.2, -0.5]]), jnp.array([[-2.0, -0.1]])
    adv, resp = jnp.array([1.0]), jnp.ones((1, 2))
    cfg = PolicyLossConfig(clip_ratio_high=0.28, sampler_is="truncate", sampler_is_cap=2.0)
    assert cfg.rollout_is_threshold == 2.0 and PolicyLossConfig().rollout_is_threshold is None
    s, d, _ = compute_policy_loss(PolicyLossInputs(old, lp, adv, resp, rollout_log_probs=roll), cfg)
    want = (-math.exp(0.2) * 2.0 - 1.0 * math.exp(-0.4)) / 2  # weights: exp(0.8) capped at 2, exp(-0.4)
    assert float(s) / float(d) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        compute_policy_loss(PolicyLossInputs(old, lp, adv, resp), cfg)


def test_kl_term_ignores_the_token_mask():
    """The token mask selects policy-gradient tokens only: the KL term is the token-mean over every valid token
    (its own denominator), by hand; ``kl_loss`` alone gives the same value."""
    lp = jnp.array([[-1.0, -0.5, -2.0, 0.0], [-0.3, -1.0, -1.0, -1.0]])
    old = jnp.array([[-1.1, -0.4, -2.2, 0.0], [-0.2, -1.3, -1.0, -1.0]])
    ref_lp = jnp.array([[-1.2, -0.7, -1.0, 0.0], [-0.1, -1.1, -1.0, -1.0]])
    adv = jnp.array([1.0, -2.0])
    resp = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    keep = jnp.array([[True, False, True, False], [False, True, False, False]])
    cfg = PolicyLossConfig(clip_ratio_c=None, use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1")
    s, d, m, pt = compute_policy_loss(PolicyLossInputs(old, lp, adv, resp, keep, ref_log_probs=ref_lp,
                                                       return_per_token=True), cfg)
    kl_tokens = np.array([0.2, 0.2, -1.0, 0.0, -0.2, 0.1])  # log_probs - ref_log_probs on the 5 valid tokens (+pad)
    assert float(d) == 3.0 and float(m["kl_loss"][1]) == 5.0  # kept tokens vs valid tokens
    assert float(safe_divide(*m["kl_loss"])) == pytest.approx((0.2 + 0.2 - 1.0 - 0.2 + 0.1) / 5)
    pg = float(safe_divide(*m["pg_loss"]))
    assert float(safe_divide(s, d)) == pytest.approx(pg + 0.5 * kl_tokens[[0, 1, 2, 4, 5]].sum() / 5, rel=1e-5)
    # the token masked out of the policy gradient (row 0, token 1) keeps its KL gradient: 0.5 / 5 for k1
    g = jax.grad(lambda x: safe_divide(*compute_policy_loss(PolicyLossInputs(old, x, adv, resp, keep,
                                                                             ref_log_probs=ref_lp), cfg)[:2]))(lp)
    assert float(g[0, 1]) == pytest.approx(0.5 / 5, rel=1e-6)
    ks, kd = kl_loss(lp, ref_lp, resp, kl_loss_type="k1")
    assert (float(ks), float(kd)) == pytest.approx((float(m["kl_loss"][0]), 5.0))
    assert float(jnp.sum(pt["loss"])) == pytest.approx(float(s), rel=1e-5)
