"""The KL term under a token mask, against both peers in float64: the token mask selects the policy-gradient tokens
only; the KL term covers every valid (response) token with its own aggregation, as verl 0.9.1's actor
(``verl/workers/utils/losses.py`` ``ppo_loss``: ``pg_loss + kl_loss_coef * agg_loss(kld, response_mask)``) and
TRL 1.16's ``GRPOTrainer._compute_loss`` (the entropy mask multiplies the surrogate, the KL is added per token after).

verl has no entropy or S2T mask: the masked recipe is verl's ``compute_policy_loss_vanilla`` with the kept tokens as
its ``response_mask`` (masked tokens leave the denominator: our ``renormalize=True``), plus verl's own
``kl_penalty`` / ``agg_loss`` over the response mask, composed as ``ppo_loss`` composes them. TRL keeps masked
tokens in its denominator (our ``renormalize=False``) and draws the entropy mask itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos

from fixtures_peers import trl_loss_and_grad, trl_trainer_view, verl_actor_config

from stapo_jax.algo.masks import s2t_mask, top_entropy_mask
from stapo_jax.algo.objectives import (PolicyLossConfig, PolicyLossInputs, compute_policy_loss, kl_has_own_denominator,
                                       safe_divide)

B, T = 6, 7
BETA = 0.1


def inputs(seed: int):
    """Ragged float64 inputs with a negative-advantage row, entropies and reference log-probs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    lp = rng.normal(size=(B, T)) * 0.6 - 1.5
    lp[0, :3] = np.log([1e-4, 5e-4, 1e-3])  # improbable tokens: S2T silences them on a positive-advantage row
    old = lp + rng.normal(size=(B, T)) * 0.3
    adv = np.repeat(rng.normal(size=(B, 1)), T, axis=1)
    adv[0] = 1.2
    ent = np.abs(rng.normal(size=(B, T))) + 0.1
    ent[0, :3] = 0.01  # low entropy, low probability, positive advantage: spurious by S2T's rule
    ref = lp + rng.normal(size=(B, T)) * 0.2
    return lp, old, adv, mask, ent, ref


def ours(lp, old, adv, mask, keep, cfg, ref, renormalize):
    """Our loss value and its gradient w.r.t. log_probs (float64), and the kl_loss metric."""
    with jax.enable_x64(True):
        def f(x):
            s, d, m = compute_policy_loss(PolicyLossInputs(jnp.asarray(old), x, jnp.asarray(adv), jnp.asarray(mask),
                                                           jnp.asarray(keep), ref_log_probs=jnp.asarray(ref),
                                                           renormalize=renormalize), cfg)
            return safe_divide(s, d), m

        (val, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
        return float(val), np.asarray(g), float(safe_divide(*m["kl_loss"]))


def verl_masked_loss(lp, old, adv, mask, keep, ref, mode, kl_type):
    """verl 0.9.1: the vanilla policy loss over the kept tokens plus ``kl_loss_coef * agg_loss(kl_penalty,
    response_mask)``, as ``verl.workers.utils.losses.ppo_loss`` adds them; value, gradient and the KL value."""
    config = verl_actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, use_kl_loss=True,
                               kl_loss_coef=BETA, kl_loss_type=kl_type, loss_agg_mode=mode)
    t_lp = torch.tensor(lp, requires_grad=True)
    kept = torch.tensor(mask * keep)
    pg, _ = core_algos.compute_policy_loss_vanilla(torch.tensor(old), t_lp, torch.tensor(adv), kept,
                                                   loss_agg_mode=mode, config=config)
    kld = core_algos.kl_penalty(logprob=t_lp, ref_logprob=torch.tensor(ref), kl_penalty=kl_type)
    kl = core_algos.agg_loss(loss_mat=kld, loss_mask=torch.tensor(mask), loss_agg_mode=mode,
                             **config.global_batch_info)
    loss = pg + kl * config.kl_loss_coef
    loss.backward()
    return float(loss.detach()), t_lp.grad.numpy(), float(kl.detach())


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("mask_name", ["top_entropy", "s2t"])
def test_kl_under_a_token_mask_matches_verl(mask_name, mode):
    """DAPO + KL + top-entropy mask and STAPO + KL: our loss and gradient equal verl's actor composition."""
    lp, old, adv, mask, ent, ref = inputs(3)
    with jax.enable_x64(True):
        if mask_name == "top_entropy":
            keep = np.asarray(top_entropy_mask(jnp.asarray(ent), jnp.asarray(mask), ratio=0.2)[0])
        else:
            keep = np.asarray(s2t_mask(jnp.asarray(lp), jnp.asarray(ent), jnp.asarray(adv), jnp.asarray(mask))[0])
    assert 0 < (keep & (mask > 0)).sum() < mask.sum()  # the mask drops some valid tokens, keeps some
    v_t, g_t, kl_t = verl_masked_loss(lp, old, adv, mask, keep, ref, mode, "low_var_kl")
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode=mode,
                           use_kl_loss=True, kl_loss_coef=BETA, kl_loss_type="low_var_kl")
    assert kl_has_own_denominator(cfg, has_token_mask=True, renormalize=True)
    v_o, g_o, kl_o = ours(lp, old, adv, mask, keep, cfg, ref, renormalize=True)
    assert abs(kl_o - kl_t) <= 1e-10 * max(1.0, abs(kl_t))
    assert abs(v_o - v_t) <= 1e-10 * max(1.0, abs(v_t))
    np.testing.assert_allclose(g_o, g_t, atol=1e-10, rtol=1e-10)
    # the masked tokens get the KL gradient only (the pre-fix loss multiplied the mask into the KL term: 0 there)
    dropped = (mask > 0) & ~keep
    assert np.all(np.abs(g_o[dropped]) > 0)


@pytest.mark.parametrize("ratio", [0.2, 0.5])
def test_dapo_kl_top_entropy_matches_trl(ratio):
    """DAPO + KL (k3, beta 0.1) + TRL's entropy mask: TRL's loss and gradient, with the KL on every valid token."""
    lp, old, adv, mask, ent, ref = inputs(5)
    view = trl_trainer_view("dapo", max_completion_length=T, beta=BETA, top_entropy_quantile=ratio)
    v_t, g_t = trl_loss_and_grad(view, lp, old, adv, mask, ent, ref)
    # the mask TRL draws (its parity with ours: test_peer_parity.py::test_trl_high_entropy_mask_and_masked_loss_match)
    keep = view.get_high_entropy_mask(torch.tensor(ent), torch.tensor(mask), 1 - ratio).numpy().astype(bool)
    assert 0 < keep.sum() < mask.sum()
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None, loss_agg_mode="token-mean",
                           use_kl_loss=True, kl_loss_coef=BETA, kl_loss_type="k3")
    v_o, g_o, _ = ours(lp, old, adv[:, 0], mask, keep, cfg, ref, renormalize=False)
    assert abs(v_o - v_t) <= 1e-10 * max(1.0, abs(v_t))
    np.testing.assert_allclose(g_o, g_t, atol=1e-10, rtol=1e-10)
