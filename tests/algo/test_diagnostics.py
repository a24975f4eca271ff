"""Diagnostics: Lemma A.1 identity vs autodiff, Theorem 3.1 bounds, C_V, phase cells by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stapo_jax.algo.diagnostics import (
    PHASE_CELLS,
    collision_probability,
    gradient_norm_bounds,
    gradient_norm_sq,
    surrogate_weight,
    token_diagnostics,
    vocab_constant,
)
from stapo_jax.algo.logprobs import logits_to_log_probs_and_entropy
from stapo_jax.algo.chunked_logprobs import chunked_log_probs_and_entropy
from stapo_jax.algo.objectives import PolicyLossConfig, PolicyLossInputs, compute_policy_loss


def test_vocab_constant_for_qwen3():
    assert abs(math.log(151936) - 11.9312) < 1e-4
    assert abs(vocab_constant(151936) - 7.0247e-3) < 1e-7


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), scale=st.floats(0.1, 8.0), c=st.sampled_from([None, 3.0, 10.0]))
def test_lemma_a1_matches_autodiff_per_token(seed, scale, c):
    with jax.enable_x64(True):  # the identity is exact; f32 cancellation in 1 - 2p + C is not the subject
        _check_lemma_a1(seed, scale, c)


def _check_lemma_a1(seed, scale, c):
    rng = np.random.default_rng(seed)
    b, t, v = 2, 4, 13
    logits = jnp.asarray(rng.normal(size=(b, t, v)) * scale, jnp.float64)
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)))
    adv = jnp.asarray(rng.normal(size=b) * 2, jnp.float64)
    lp0, _ = logits_to_log_probs_and_entropy(logits, ids)
    old = lp0 + jnp.asarray(rng.normal(size=(b, t)) * 0.5, jnp.float64)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c)
    resp = jnp.ones((b, t))

    def total(z):  # token-mean sum = sum of per-token losses; token (b,t) depends only on z[b,t]
        lp, _ = logits_to_log_probs_and_entropy(z, ids)
        return compute_policy_loss(PolicyLossInputs(old, lp, adv, resp), cfg)[0]

    g = jax.grad(total)(logits)
    autodiff = np.asarray(jnp.sum(g * g, -1))
    w = surrogate_weight(lp0 - old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=c)
    analytic = np.asarray(gradient_norm_sq(lp0, collision_probability(logits, token_ids=ids), w))
    np.testing.assert_allclose(analytic, autodiff, rtol=1e-9, atol=1e-12)


def _dists(v, rng):
    yield np.full(v, 1.0 / v)  # uniform: upper bound tight
    p = np.full(v, 1e-12)
    p[0] = 1.0
    yield p / p.sum()  # near point mass
    for scale in (0.5, 3.0, 10.0, 30.0):
        z = rng.normal(size=v) * scale
        e = np.exp(z - z.max())
        yield e / e.sum()


def test_theorem_3_1_bounds_hold_random_and_peaked():
    rng = np.random.default_rng(0)
    for v in (2, 7, 1000, 151936):
        for pi in _dists(v, rng):
            h = -np.sum(pi * np.log(np.maximum(pi, 1e-300)))
            c = np.sum(pi * pi)
            for y in (0, int(np.argmax(pi)), v - 1):
                p = pi[y]
                g = 1 - 2 * p + c
                lo, hi = gradient_norm_bounds(p, h, 1.0, v)
                assert lo - 1e-9 <= g <= hi + 1e-9, (v, p, h, c, lo, g, hi)


def test_token_diagnostics_by_hand():
    # 4 valid tokens + 1 pad; tau_p = 0.01, tau_h = 1.0
    p = np.array([[0.001, 0.5, 0.001, 0.5, 0.3]])
    ent = np.array([[0.5, 0.5, 2.0, 2.0, 0.1]])
    resp = np.array([[1, 1, 1, 1, 0]], np.float32)
    keep = np.array([[False, True, True, True, False]])
    lp = jnp.asarray(np.log(p), jnp.float32)
    out = token_diagnostics(lp, jnp.asarray(ent, jnp.float32), jnp.array([1.0]), lp, jnp.asarray(resp),
                            jnp.asarray(keep), tau_p=0.01, tau_h=1.0, clip_ratio_low=0.2, clip_ratio_high=0.28,
                            vocab_size=100, collision_others=jnp.asarray(np.full_like(p, 0.01), jnp.float32))
    f = {k: float(s) / float(w) for k, (s, w) in out.items() if float(w) > 0}
    assert f["s2t/masked_frac"] == 0.25 and f["s2t/frac_pos_lowp"] == 0.5 and f["s2t/frac_below_tau_h"] == 0.5
    assert f["s2t/n_keep"] == 3.0
    assert f["phase/plow_apos_hlow/frac"] == 0.25 and f["phase/phigh_apos_hhigh/frac"] == 0.25
    assert f["phase/plow_apos_hhigh/frac"] == 0.25 and f["phase/phigh_apos_hlow/frac"] == 0.25
    assert all(float(out[f"phase/{c}/frac"][0]) == 0 for c in PHASE_CELLS if "aneg" in c)
    # ratio 1, A = 1 -> w = 1: g = 1 - 2p + C
    np.testing.assert_allclose(f["phase/plow_apos_hlow/g_mean"], 1 - 2 * 0.001 + 0.001**2 + 0.01, rtol=1e-5)
    # the fabricated C is inconsistent with H on some tokens: the violation counter must see exactly those
    c = p**2 + 0.01
    exact, lo, hi = 1 - 2 * p + c, 1 - 2 * p + np.exp(-ent), 2 - 2 * p - vocab_constant(100) * ent**2
    expected = (((exact < lo - 1e-5) | (exact > hi + 1e-5)) & (resp > 0)).sum()
    assert expected > 0 and float(out["grad/bounds_violated"][0]) == expected


def test_chunked_collision_equals_direct():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(2, 7, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 29)) * 2, jnp.float32)
    ids = jnp.asarray(rng.integers(0, 29, size=(2, 7)))
    direct = collision_probability(h @ w, token_ids=ids)
    for vc in (None, 8):
        _, _, c = chunked_log_probs_and_entropy(h, w, ids, seq_chunk=3, vocab_chunk=vc, with_collision=True)
        np.testing.assert_allclose(np.asarray(c), np.asarray(direct), rtol=1e-5)


def test_surrogate_weight_is_zero_beyond_the_log_ratio_clamp():
    """A = -1, log_prob = 0, old_log_prob = -25, no dual clip: the loss's clamp(-20, 20) has zero gradient there,
    so the weight is 0 (the weight of exp(clamp(delta)) A would be -4.85e8); it agrees with autodiff of the loss."""
    lp, old, adv = jnp.array([[0.0, -1.0]]), jnp.array([[-25.0, -1.1]]), jnp.array([-1.0])
    w = surrogate_weight(lp - old, adv, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    g = jax.grad(lambda x: compute_policy_loss(PolicyLossInputs(old, x, adv, jnp.ones((1, 2))), cfg)[0])(lp)
    assert float(w[0, 0]) == 0.0 and float(g[0, 0]) == 0.0
    np.testing.assert_allclose(float(w[0, 1]), -float(g[0, 1]), rtol=1e-6)
    assert abs(float(w[0, 1]) + math.exp(0.1)) < 1e-5


def test_gradient_norm_is_accurate_in_float32_as_p_goes_to_one():
    """Logits 0 except 14 on the sampled token: float32 (1 - p)^2 + C' equals the float64 value to 1e-2
    relative (the float32 rounding of log_probs ~ -1e-5 itself), where 1 - 2p + C cancels to 0 or worse; random
    inputs agree to 1e-5 relative."""
    rng = np.random.default_rng(0)
    for v, top in ((32, 14.0), (1000, 14.0), (4325, 14.0)):  # V = 4325: the true value is 1.28e-5
        z = np.zeros((1, v))
        z[0, 3] = top
        ids = np.array([3])
        with jax.enable_x64(True):
            lp64 = logits_to_log_probs_and_entropy(jnp.asarray(z, jnp.float64), jnp.asarray(ids))[0]
            want = float(gradient_norm_sq(lp64, collision_probability(jnp.asarray(z), token_ids=jnp.asarray(ids)),
                                          1.0)[0])
        lp32 = logits_to_log_probs_and_entropy(jnp.asarray(z, jnp.float32), jnp.asarray(ids))[0]
        got = float(gradient_norm_sq(lp32, collision_probability(jnp.asarray(z, jnp.float32),
                                                                 token_ids=jnp.asarray(ids)), 1.0)[0])
        p32 = jnp.exp(lp32)
        textbook = float((1.0 - 2.0 * p32 + collision_probability(jnp.asarray(z, jnp.float32)))[0])
        assert want > 0 and abs(got - want) <= 1e-2 * want, (v, got, want)
        assert abs(textbook - want) > 10 * abs(got - want), (v, textbook, got, want)
    z = rng.normal(size=(64, 50)) * 3
    ids = rng.integers(0, 50, size=64)
    with jax.enable_x64(True):
        lp64 = logits_to_log_probs_and_entropy(jnp.asarray(z), jnp.asarray(ids))[0]
        want = np.asarray(gradient_norm_sq(lp64, collision_probability(jnp.asarray(z), token_ids=jnp.asarray(ids)),
                                           1.0))
    lp32 = logits_to_log_probs_and_entropy(jnp.asarray(z, jnp.float32), jnp.asarray(ids))[0]
    got = np.asarray(gradient_norm_sq(lp32, collision_probability(jnp.asarray(z, jnp.float32),
                                                                  token_ids=jnp.asarray(ids)), 1.0))
    np.testing.assert_allclose(got, want, rtol=1e-5)
