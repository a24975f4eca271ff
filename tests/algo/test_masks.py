"""Token masks: S2T and 20-Entropy vs the PyTorch reference, properties (hypothesis), exactness when sharded."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import torch_reference as ref  # noqa: E402

from stapo_jax.algo.masks import (  # noqa: E402
    S2TConfig,
    TopEntropyConfig,
    clip_cov_mask,
    kl_cov_mask,
    masked_quantile,
    s2t_mask,
    top_entropy_mask,
)
from xla_env import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_stats(seed, b=5, t=7):
    rng = np.random.default_rng(seed)
    lp = np.log(rng.uniform(1e-5, 1.0, size=(b, t))) * rng.choice([1.0, 3.0], size=(b, t))
    ent = rng.gamma(1.0, 1.0, size=(b, t))
    adv = rng.normal(size=b)
    resp = (np.arange(t)[None] < rng.integers(0, t + 1, size=b)[:, None]).astype(np.float64)
    return lp, ent, adv, resp


@pytest.mark.parametrize("method", ["linear", "nearest", "topk_ceil"])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.8, 0.93, 1.0])
def test_masked_quantile_matches_torch(method, q):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6))
    valid = rng.random((4, 6)) < 0.6
    with jax.enable_x64(True):
        ours = float(masked_quantile(jnp.asarray(x), jnp.asarray(valid), q, method))
    theirs = ref.quantile(torch.tensor(x[valid]), q, method).item()
    assert abs(ours - theirs) < 1e-12
    assert np.isnan(float(masked_quantile(jnp.asarray(x), jnp.zeros((4, 6), bool), q, method)))  # empty: NaN


@pytest.mark.parametrize("method", ["linear", "nearest", "topk_ceil"])
def test_masked_quantile_with_infinite_and_nan_values(method):
    """A valid +inf is ordered above every finite value (not behind the padding of invalid entries), two equal
    infinite neighbours interpolate to themselves (torch.quantile's lerp gives NaN there: inf + 0 * (inf - inf)),
    and a valid NaN gives NaN, as ``torch.quantile`` does; an invalid inf or NaN is ignored."""
    x = np.array([[1.0, 3.0, np.inf, 2.0], [np.inf, np.nan, -np.inf, 0.5]])
    valid = np.array([[True, True, True, True], [False, False, False, True]])
    for q in (0.0, 0.3, 0.7):
        ours = float(masked_quantile(jnp.asarray(x, jnp.float32), jnp.asarray(valid), q, method))
        theirs = ref.quantile(torch.tensor(x[valid], dtype=torch.float32), q, method).item()
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, err_msg=f"q={q}")  # equal infinities pass
    assert float(masked_quantile(jnp.asarray(x), jnp.asarray(valid), 1.0, method)) == np.inf  # the largest
    both = np.array([5.0, np.inf, np.inf])
    assert float(masked_quantile(jnp.asarray(both), jnp.ones(3, bool), 0.75, method)) == np.inf
    nan_valid = valid.copy()
    nan_valid[1, 1] = True
    assert np.isnan(float(masked_quantile(jnp.asarray(x), jnp.asarray(nan_valid), 0.5, method)))
    if method != "topk_ceil":  # torch.topk (the 80/20 code's rule) orders NaN instead
        assert np.isnan(ref.quantile(torch.tensor(x[nan_valid]), 0.5, method).item())
    if method == "linear":  # between -inf and 2 at weight 0.8: -inf (a + w (b - a) would be NaN)
        assert float(masked_quantile(jnp.asarray([-np.inf, 2.0, 3.0]), jnp.ones(3, bool), 0.4, method)) == -np.inf
    with pytest.raises(ValueError, match="values must be a float array, got dtype int32"):
        masked_quantile(jnp.arange(4), jnp.ones(4, bool), 0.5, method)
    # 70,000 float16 values: the rank q (n - 1) is beyond float16's range (65,504); computed in float32 it is not
    half = jnp.linspace(0.0, 1.0, 70_000).astype(jnp.float16)
    got = masked_quantile(half, jnp.ones(70_000, bool), 0.5, method)
    assert got.dtype == jnp.float16 and abs(float(got) - 0.5) < 1e-3, float(got)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tokens", ["valid", "positive_adv", "candidates"])
def test_s2t_matches_torch(seed, tokens):
    lp, ent, adv, resp = random_stats(seed)
    adv_t = adv[:, None] * resp
    keep, tau = s2t_mask(jnp.asarray(lp), jnp.asarray(ent), jnp.asarray(adv), jnp.asarray(resp), tau_p=0.05,
                         quantile_tokens=tokens)
    tkeep, ttau = ref.s2t_mask(torch.tensor(lp), torch.tensor(ent), torch.tensor(adv_t), torch.tensor(resp), 0.05,
                               0.8, "linear", tokens)
    np.testing.assert_array_equal(np.asarray(keep), tkeep.numpy())
    np.testing.assert_allclose(float(tau), ttau.item(), rtol=1e-6)


def test_s2t_candidates_population_by_hand():
    """quantile_tokens='candidates': tau_h is the quantile over A > 0 and p < tau_p tokens only (entropies
    0, 1, 3, 4 -> Q_0.5 = 2.0), so the token of entropy 1 is silenced and the one of entropy 3 kept."""
    lp = jnp.log(jnp.array([[0.001, 0.001, 0.5, 0.001, 0.001, 0.001]]))
    ent = jnp.array([[0.0, 1.0, 2.5, 3.0, 4.0, 0.0]])
    resp = jnp.array([[1, 1, 1, 1, 1, 0]])
    keep, tau = s2t_mask(lp, ent, jnp.array([1.0]), resp, entropy_quantile=0.5, quantile_tokens="candidates")
    np.testing.assert_allclose(float(tau), 2.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(keep), [[False, False, True, True, True, False]])
    keep, tau = s2t_mask(lp, ent, jnp.array([1.0]), resp, entropy_quantile=0.5, quantile_tokens="valid")
    np.testing.assert_allclose(float(tau), 2.5, rtol=1e-6)  # the valid population includes the p = 0.5 token


def test_s2t_by_hand():
    # 5 valid tokens, entropies 0..4 -> tau_h = Q_0.8 = 3.2; silence iff A>0, p<0.002, H<3.2
    lp = jnp.log(jnp.array([[0.001, 0.001, 0.5, 0.001, 0.001, 0.001]]))
    ent = jnp.array([[0.0, 1.0, 2.0, 3.0, 4.0, 0.0]])
    resp = jnp.array([[1, 1, 1, 1, 1, 0]])
    keep, tau = s2t_mask(lp, ent, jnp.array([1.0]), resp)
    np.testing.assert_allclose(float(tau), 3.2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(keep), [[False, False, True, False, True, False]])
    keep, _ = s2t_mask(lp, ent, jnp.array([-1.0]), resp)  # negative advantage: never silenced
    np.testing.assert_array_equal(np.asarray(keep), [[True, True, True, True, True, False]])


def test_top_entropy_matches_official_topk():
    for seed in range(4):
        _, ent, _, resp = random_stats(seed, 6, 9)
        ours = np.asarray(top_entropy_mask(jnp.asarray(ent), jnp.asarray(resp), ratio=0.2)[0])
        theirs = ref.top_entropy_mask(torch.tensor(ent), torch.tensor(resp), 0.2).numpy()
        np.testing.assert_array_equal(ours, theirs)
    keep, thr = top_entropy_mask(jnp.ones((2, 3)), jnp.zeros((2, 3)))
    assert not np.asarray(keep).any() and np.isnan(float(thr))


def test_cov_masks():
    lp, ent, adv, resp = random_stats(7, 8, 10)
    sel, thr = kl_cov_mask(jnp.asarray(lp), jnp.asarray(adv), jnp.asarray(resp), kl_cov_ratio=0.1)
    sel = np.asarray(sel)
    valid = resp.astype(bool)
    advt = np.broadcast_to(adv[:, None], lp.shape)
    cov = (advt - advt[valid].mean()) * (lp - lp[valid].mean())
    k = max(1, int(valid.sum() * 0.1))
    expect = np.zeros_like(valid)
    flat = np.where(valid, cov, -np.inf).ravel()
    expect.ravel()[np.argsort(-flat)[:k]] = True
    np.testing.assert_array_equal(sel, expect)
    np.testing.assert_allclose(float(thr), np.sort(flat)[::-1][k - 1], rtol=1e-6)
    keep, thr = clip_cov_mask(jnp.asarray(lp), jnp.asarray(lp), jnp.asarray(adv), jnp.asarray(resp),
                              jax.random.PRNGKey(0), clip_ratio_low=0.2, clip_ratio_high=0.28,
                              clip_cov_ratio=0.05, clip_cov_lb=-1e9, clip_cov_ub=1e9)
    keep = np.asarray(keep)
    assert (valid & ~keep).sum() == max(1, int(0.05 * valid.sum())) and not (keep & ~valid).any()
    np.testing.assert_allclose(float(thr), cov[valid & ~keep].min(), rtol=1e-5)


def test_every_mask_has_one_return_style_and_nan_for_an_empty_population():
    """Each registered mask returns (mask, threshold); with no valid token the threshold is NaN and the mask
    all False, and the registry names what each mask reads."""
    from stapo_jax.algo.masks import TOKEN_MASKS

    assert set(TOKEN_MASKS) == {"s2t", "top_entropy", "clip_cov", "kl_cov"}
    stats = dict(log_probs=jnp.full((2, 3), -1.0), entropy=jnp.ones((2, 3)), advantages=jnp.array([1.0, -1.0]),
                 old_log_probs=jnp.full((2, 3), -1.0), key=jax.random.PRNGKey(0))
    for name, spec in TOKEN_MASKS.items():
        kw = {n: stats[n] for n in spec.needs}
        mask, thr = spec.fn(response_mask=jnp.zeros((2, 3)), **kw)
        assert mask.dtype == jnp.bool_ and mask.shape == (2, 3) and not np.asarray(mask).any(), name
        assert np.isnan(float(thr)), name
    assert TOKEN_MASKS["kl_cov"].selects and not TOKEN_MASKS["s2t"].selects
    assert TOKEN_MASKS["clip_cov"].needs == ("log_probs", "old_log_probs", "advantages", "key")
    assert "entropy" not in TOKEN_MASKS["kl_cov"].needs + TOKEN_MASKS["clip_cov"].needs


def test_config_validation():
    with pytest.raises(ValueError, match="quantile_scope"):
        S2TConfig(quantile_scope="device")
    with pytest.raises(ValueError, match="tau_p"):
        S2TConfig(tau_p=0.0)
    with pytest.raises(ValueError, match="ratio"):
        TopEntropyConfig(ratio=0.0)
    with pytest.raises(ValueError, match="entropy shape"):
        s2t_mask(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2), jnp.ones((2, 3)))
    for bad in (0.0, -1.0, 2.0, float("nan")):  # the pure function checks tau_p as S2TConfig does
        with pytest.raises(ValueError, match="tau_p must be in"):
            s2t_mask(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones(2), jnp.ones((2, 3)), tau_p=bad)
    keep, _ = s2t_mask(jnp.full((2, 3), -9.0), jnp.zeros((2, 3)), jnp.ones(2), jnp.ones((2, 3)), tau_p=1.0)
    assert keep.shape == (2, 3)  # tau_p = 1 (the bound) is accepted


_stats = st.integers(0, 2**16).map(lambda s: random_stats(s, 3, 5))


@settings(max_examples=25, deadline=None)
@given(_stats, st.sampled_from(["linear", "nearest", "topk_ceil"]), st.floats(0.01, 1.0))
def test_s2t_never_masks_nonpositive_advantage(stats, method, tau_p):
    lp, ent, adv, resp = stats
    keep = np.asarray(s2t_mask(jnp.asarray(lp), jnp.asarray(ent), jnp.asarray(adv), jnp.asarray(resp),
                               tau_p=tau_p, quantile_method=method)[0])
    valid = resp.astype(bool)
    silenced = valid & ~keep
    assert not (silenced & (adv[:, None] <= 0)).any()
    assert not (keep & ~valid).any()


@settings(max_examples=25, deadline=None)
@given(_stats, st.integers(0, 2**16), st.booleans())
def test_masks_invariant_to_token_order(stats, perm_seed, ties):
    lp, ent, adv, resp = stats
    if ties:
        ent = np.round(ent, 0)  # many equal entropies
    advt = np.broadcast_to(adv[:, None], lp.shape).copy()
    perm = np.random.default_rng(perm_seed).permutation(lp.size)

    def run(lp, ent, advt, resp):
        k1 = s2t_mask(jnp.asarray(lp), jnp.asarray(ent), jnp.asarray(advt), jnp.asarray(resp), tau_p=0.3)[0]
        k2 = top_entropy_mask(jnp.asarray(ent), jnp.asarray(resp), ratio=0.3)[0]
        return np.asarray(k1).ravel(), np.asarray(k2).ravel()

    base = run(lp, ent, advt, resp)
    shuffled = run(*(x.ravel()[perm].reshape(1, -1) for x in (lp, ent, advt, resp)))
    for a, b in zip(base, shuffled):
        np.testing.assert_array_equal(a[perm], b)


SHARDED_SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P, NamedSharding
    from stapo_jax.algo.masks import s2t_mask, top_entropy_mask
    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    b, t = 16, 11
    lp = jnp.asarray(np.log(rng.uniform(1e-4, 1, (b, t))), jnp.float32)
    ent = jnp.asarray(rng.gamma(1.0, 1.0, (b, t)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=b), jnp.float32)
    resp = jnp.asarray(np.arange(t)[None] < rng.integers(0, t + 1, b)[:, None], jnp.float32)
    ref_keep, ref_tau = s2t_mask(lp, ent, adv, resp, tau_p=0.05)
    ref_top = top_entropy_mask(ent, resp, ratio=0.2)[0]
    mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    spec = P(("data", "fsdp"))
    def local(lp, ent, adv, resp):
        k, tau = s2t_mask(lp, ent, adv, resp, tau_p=0.05, axis_name=("data", "fsdp"))
        top = top_entropy_mask(ent, resp, ratio=0.2, axis_name=("data", "fsdp"))[0]
        return k, jnp.broadcast_to(tau, (lp.shape[0],)), top
    sh = NamedSharding(mesh, spec)
    lp_s, ent_s, adv_s, resp_s = (jax.device_put(x, sh) for x in (lp, ent, adv, resp))
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=(spec, spec, spec)))
    k, tau, top = f(lp_s, ent_s, adv_s, resp_s)
    np.testing.assert_array_equal(np.asarray(k), np.asarray(ref_keep))
    np.testing.assert_array_equal(np.asarray(top), np.asarray(ref_top))
    assert np.all(np.asarray(tau) == float(ref_tau)), (tau, ref_tau)
    # without the gather, per-shard thresholds differ (the test can tell the scopes apart)
    g = jax.jit(jax.shard_map(lambda e, r: top_entropy_mask(e, r, ratio=0.2)[0], mesh=mesh, in_specs=(spec, spec),
                              out_specs=spec))
    assert not np.array_equal(np.asarray(g(ent_s, resp_s)), np.asarray(ref_top))
    # plain jit on sharded inputs (GSPMD): global population automatically
    h = jax.jit(lambda *a: s2t_mask(*a, tau_p=0.05))
    k2, tau2 = h(lp_s, ent_s, adv_s, resp_s)
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(ref_keep))
    print("SHARDED_OK", int((np.asarray(resp) > 0).sum() - np.asarray(ref_keep).sum()))
    """
)


def test_global_quantile_exact_on_8_simulated_devices():
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SHARDED_OK" in out.stdout
    assert int(out.stdout.split("SHARDED_OK")[1].split()[0]) > 0  # the mask silenced something
