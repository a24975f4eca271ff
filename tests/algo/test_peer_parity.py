"""Parity against the real peers, side by side in float64: verl 0.9.1 ``core_algos`` and TRL 1.16's GRPO loss.

Every function is called from the installed package (``verl==0.9.1``, ``trl==1.16.0``, requirements-test.txt),
never from a copy. Values and gradients agree within 1e-10 unless a documented convention differs:

* TRL ``grpo`` divides each sequence by ``max(n_b, 1)``, verl (and we) by ``n_b + 1e-8``: relative 1e-8 / n_b.
* TRL has no ±20 log-ratio clamp and no dual clip: ours with ``clip_ratio_c=None`` (inputs well inside ±20).
* TRL's entropy mask uses ``torch.quantile`` (linear) and keeps masked tokens in the denominator:
  ``top_entropy_mask(quantile_method='linear')`` with ``renormalize=False``.
* TRL ``dr_grpo`` / ``luspo`` divide by all rows, verl 0.9.1 (and we) by the non-empty rows: equal here (no
  empty row). TRL ``cispo``, ``sapo``, ``vespo`` have no counterpart here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.workers.config.actor import PolicyLossConfig as VerlPolicyLossConfig

from fixtures_peers import policy_inputs, trl_loss_and_grad, trl_trainer_view, verl_actor_config

from stapo_jax.algo.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from stapo_jax.algo.masks import clip_cov_mask, kl_cov_mask, top_entropy_mask
from stapo_jax.algo.objectives import (KL_TYPES, PolicyLossConfig, PolicyLossInputs, aggregate, compute_policy_loss,
                                       kl_penalty, safe_divide)
from stapo_jax.tools.dump import TRL_LOSS_AGG_MODES

B, T = 6, 7
VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _ours_loss_and_grad(lp, old, adv, mask, cfg, token_mask=None, renormalize=True, kl_cov_selection=None):
    with jax.enable_x64(True):
        def f(x):
            inputs = PolicyLossInputs(jnp.asarray(old), x, jnp.asarray(adv), jnp.asarray(mask),
                                      None if token_mask is None else jnp.asarray(token_mask),
                                      renormalize=renormalize,
                                      kl_cov_selection=None if kl_cov_selection is None else
                                      jnp.asarray(kl_cov_selection))
            s, d, m = compute_policy_loss(inputs, cfg)
            return safe_divide(s, d), m

        (val, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp, jnp.float64))
        # verl's masked_mean divides by (count + 1e-8)
        return float(val), np.asarray(g), {k: float(s) / (float(w) + 1e-8) for k, (s, w) in m.items()}


def _verl_loss_and_grad(fn, lp, old, adv, mask, mode, config):
    t_lp = torch.tensor(lp, requires_grad=True)
    loss, metrics = fn(torch.tensor(old), t_lp, torch.tensor(adv), torch.tensor(mask), loss_agg_mode=mode,
                       config=config)
    loss.backward()
    return float(loss.detach()), t_lp.grad.numpy(), metrics


@pytest.mark.parametrize("mode", VERL_AGG_MODES)
def test_agg_loss_matches_verl(mode):
    rng = np.random.default_rng(1)
    loss_mat = rng.normal(size=(B, T))
    _, _, _, mask = policy_inputs(1, B, T)
    theirs = float(core_algos.agg_loss(torch.tensor(loss_mat), torch.tensor(mask), mode))
    with jax.enable_x64(True):
        m = jnp.asarray(mask)
        ours = float(safe_divide(*aggregate(jnp.asarray(loss_mat), m, m, mode)))
    assert abs(ours - theirs) <= 1e-10 * max(1.0, abs(theirs))


@pytest.mark.parametrize("mode", VERL_AGG_MODES)
@pytest.mark.parametrize("clip_ratio_c", [3.0, 10.0])
def test_policy_loss_vanilla_matches_verl(mode, clip_ratio_c):
    lp, old, adv, mask = policy_inputs(2, B, T)
    adv[1] = -2.5  # a negative advantage with a large ratio somewhere exercises the dual clip
    old[1, 0] = lp[1, 0] - 3.0  # ratio e^3 > c
    cfg = verl_actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c)
    v_t, g_t, m_t = _verl_loss_and_grad(core_algos.compute_policy_loss_vanilla, lp, old, adv, mask, mode, cfg)
    ours_cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c,
                                loss_agg_mode=mode)
    v_o, g_o, m_o = _ours_loss_and_grad(lp, old, adv, mask, ours_cfg)
    assert abs(v_o - v_t) <= 1e-10 * max(1.0, abs(v_t))
    np.testing.assert_allclose(g_o, g_t, atol=1e-10, rtol=1e-10)
    for name in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
        assert abs(m_o[name] - m_t[f"actor/{name}"]) <= 1e-10, name
    assert m_t["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_penalty_matches_verl(kl_type):
    rng = np.random.default_rng(3)
    lp, ref = rng.normal(size=(3, 5)) - 1.0, rng.normal(size=(3, 5)) - 1.0
    lp[0, 0], ref[0, 0] = -30.0, -2.0  # beyond the k3 clamps
    t_lp = torch.tensor(lp, requires_grad=True)
    theirs = core_algos.kl_penalty(t_lp, torch.tensor(ref), kl_type)
    theirs.sum().backward()
    with jax.enable_x64(True):
        ours, g = jax.value_and_grad(lambda x: jnp.sum(kl_penalty(x, jnp.asarray(ref), kl_type)))(jnp.asarray(lp))
        per_token = np.asarray(kl_penalty(jnp.asarray(lp), jnp.asarray(ref), kl_type))
    np.testing.assert_allclose(per_token, theirs.detach().numpy(), atol=1e-12, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g), t_lp.grad.numpy(), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_outcome_advantages_match_verl_with_any_uids(estimator):
    rng = np.random.default_rng(4)
    uids = np.array([1000, -5, 1000, 7, -5, 7, 1000, 42, 7, -5], np.int64)  # 42: a single-sample group
    scores = rng.integers(0, 2, size=uids.size).astype(np.float64)
    scores[[3, 5, 8]] = 1.0  # group 7 all equal
    mask = np.ones((uids.size, 3))
    token_rewards = np.zeros_like(mask)
    token_rewards[:, -1] = scores
    if estimator == "rloo":
        theirs, _ = core_algos.compute_rloo_outcome_advantage(torch.tensor(token_rewards), torch.tensor(mask), uids)
        fn = rloo_advantages
    else:
        theirs, _ = core_algos.compute_grpo_outcome_advantage(torch.tensor(token_rewards), torch.tensor(mask), uids,
                                                              norm_adv_by_std_in_grpo=estimator == "grpo")
        fn = grpo_advantages if estimator == "grpo" else dr_grpo_advantages
    with jax.enable_x64(True):
        ours = np.asarray(fn(jnp.asarray(scores), jnp.asarray(uids), single_sample="verl"))
        jitted = np.asarray(jax.jit(functools.partial(fn, single_sample="verl"))(jnp.asarray(scores),
                                                                                  jnp.asarray(uids)))
    np.testing.assert_allclose(ours, theirs[:, 0].numpy(), atol=1e-10, rtol=1e-10)
    np.testing.assert_array_equal(jitted, ours)


def _verl_clip_cov_priority(lp, old, adv, mask, seed, clip_ratio_low, clip_ratio_high, lb, ub):
    """The permutation verl's ``compute_policy_loss_clip_cov`` draws after ``torch.manual_seed(seed)``, as a
    priority over its candidates (row-major ``torch.nonzero`` order): replays verl's random choice."""
    la, lo, a, m = (torch.tensor(x) for x in (lp, old, adv, mask))
    ratio = torch.exp(la - lo)
    clipped = (-a * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high) > -a * ratio) & (m > 0)
    mean = lambda x: (x * m).sum() / m.sum()  # noqa: E731
    cov = (a - mean(a)) * (la - mean(la))
    cov[m == 0] = -torch.inf
    cov[clipped] = -torch.inf
    cand = torch.nonzero((cov < ub) & (cov > lb) & (m > 0))
    torch.manual_seed(seed)
    perm = torch.randperm(len(cand))
    priority = np.zeros(lp.shape)
    for rank, j in enumerate(perm.tolist()):
        priority[tuple(cand[j].tolist())] = len(cand) - rank
    return priority, len(cand)


def _cov_inputs(seed, short_row, short_from, b=8, t=40):
    """Wider-spread log-probs and advantages than :func:`fixtures_peers.policy_inputs`, so covariances reach the
    Cov bounds."""
    rng = np.random.default_rng(seed)
    mask = np.ones((b, t))
    mask[short_row, short_from:] = 0
    lp = rng.normal(size=(b, t)) * 1.5 - 2.0
    old = lp + rng.normal(size=(b, t)) * 0.1
    adv = np.repeat(rng.normal(size=(b, 1)) * 2, t, axis=1)
    return lp, old, adv, mask


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_clip_cov_matches_verl_replaying_its_draw(mode):
    lp, old, adv, mask = _cov_inputs(5, 3, 25)
    ratio_c, lb, ub = 0.05, 0.5, 5.0
    cfg = verl_actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss=VerlPolicyLossConfig(
        loss_mode="clip_cov", clip_cov_ratio=ratio_c, clip_cov_lb=lb, clip_cov_ub=ub))
    priority, n_cand = _verl_clip_cov_priority(lp, old, adv, mask, 0, 0.2, 0.28, lb, ub)
    assert n_cand > int(ratio_c * mask.sum()) > 1  # the draw matters
    torch.manual_seed(0)
    v_t, g_t, _ = _verl_loss_and_grad(core_algos.compute_policy_loss_clip_cov, lp, old, adv, mask, mode, cfg)
    with jax.enable_x64(True):
        keep = clip_cov_mask(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                             jax.random.PRNGKey(0), clip_ratio_low=0.2, clip_ratio_high=0.28, clip_cov_ratio=ratio_c,
                             clip_cov_lb=lb, clip_cov_ub=ub, priority=jnp.asarray(priority))[0]
    ours_cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None, loss_agg_mode=mode)
    v_o, g_o, _ = _ours_loss_and_grad(lp, old, adv, mask, ours_cfg, token_mask=np.asarray(keep), renormalize=False)
    assert abs(v_o - v_t) <= 1e-10 * max(1.0, abs(v_t))
    np.testing.assert_allclose(g_o, g_t, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_kl_cov_matches_verl(mode):
    lp, old, adv, mask = _cov_inputs(6, 5, 10)
    cfg = verl_actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28,
                        policy_loss=VerlPolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.02))
    v_t, g_t, _ = _verl_loss_and_grad(core_algos.compute_policy_loss_kl_cov, lp, old, adv, mask, mode, cfg)
    with jax.enable_x64(True):
        sel = kl_cov_mask(jnp.asarray(lp), jnp.asarray(adv), jnp.asarray(mask), kl_cov_ratio=0.02)[0]
    assert int(np.asarray(sel).sum()) == max(1, int(0.02 * mask.sum()))
    ours_cfg = PolicyLossConfig(loss_agg_mode=mode)  # ppo_kl_coef 0.1 = verl's default
    assert ours_cfg.ppo_kl_coef == cfg.policy_loss.ppo_kl_coef
    v_o, g_o, _ = _ours_loss_and_grad(lp, old, adv, mask, ours_cfg, kl_cov_selection=np.asarray(sel))
    assert abs(v_o - v_t) <= 1e-10 * max(1.0, abs(v_t))
    np.testing.assert_allclose(g_o, g_t, atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------------------------------------ TRL


# TRL loss_type -> our loss_agg_mode (with loss_scale_factor = max_completion_length for dr_grpo): the table
# stapo_jax.tools.dump writes into a TRL dump's settings, so this test checks the one check uses
TRL_MODES = TRL_LOSS_AGG_MODES


@pytest.mark.parametrize("loss_type", sorted(TRL_MODES))
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trl_grpo_loss_matches(loss_type, beta):
    lp, old, adv, mask = policy_inputs(7, B, T, empty_row=False)
    ref = lp + np.random.default_rng(8).normal(size=lp.shape) * 0.2
    ent = np.abs(np.random.default_rng(9).normal(size=lp.shape))
    view = trl_trainer_view(loss_type, max_completion_length=T, beta=beta)
    v_t, g_t = trl_loss_and_grad(view, lp, old, adv, mask, ent, ref)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None,
                           loss_agg_mode=TRL_MODES[loss_type], loss_scale_factor=float(T),
                           use_kl_loss=beta > 0, kl_loss_coef=beta, kl_loss_type="k3")
    with jax.enable_x64(True):
        def f(x):
            s, d, _ = compute_policy_loss(PolicyLossInputs(jnp.asarray(old), x, jnp.asarray(adv[:, 0]),
                                                           jnp.asarray(mask), ref_log_probs=jnp.asarray(ref)), cfg)
            return safe_divide(s, d)

        v_o, g_o = jax.value_and_grad(f)(jnp.asarray(lp))
    # TRL grpo: s_b / max(n_b, 1) where verl and we use s_b / (n_b + 1e-8), a relative 1e-8 / n_b
    tol = 2e-8 if loss_type == "grpo" else 1e-10
    assert abs(float(v_o) - v_t) <= tol * max(1.0, abs(v_t))
    np.testing.assert_allclose(np.asarray(g_o), g_t, atol=tol, rtol=tol)


@pytest.mark.parametrize("ratio", [0.2, 0.5, 1.0])
def test_trl_high_entropy_mask_and_masked_loss_match(ratio):
    lp, old, adv, mask = policy_inputs(10, B, T, empty_row=False)
    ent = np.abs(np.random.default_rng(11).normal(size=lp.shape))
    view = trl_trainer_view("bnpo", max_completion_length=T, top_entropy_quantile=ratio)
    theirs = view.get_high_entropy_mask(torch.tensor(ent), torch.tensor(mask), 1 - ratio).numpy()
    with jax.enable_x64(True):
        ours = np.asarray(top_entropy_mask(jnp.asarray(ent), jnp.asarray(mask), ratio=ratio,
                                           quantile_method="linear")[0])
    np.testing.assert_array_equal(ours, theirs)
    v_t, g_t = trl_loss_and_grad(view, lp, old, adv, mask, ent)
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None, loss_agg_mode="token-mean")
    v_o, g_o, _ = _ours_loss_and_grad(lp, old, adv, mask, cfg, token_mask=ours, renormalize=False)
    assert abs(v_o - v_t) <= 1e-10 * max(1.0, abs(v_t))
    np.testing.assert_allclose(g_o, g_t, atol=1e-10, rtol=1e-10)
