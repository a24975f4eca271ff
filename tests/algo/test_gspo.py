"""The ``gspo`` policy loss (stapo_jax/algo/policy_losses/gspo.py) against verl 0.9.1's
``core_algos.compute_policy_loss_gspo`` itself, float64, value / gradient / metrics within 1e-10; and its selection
from YAML (``actor.policy_loss: gspo``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from verl.trainer.ppo import core_algos

from fixtures_peers import verl_actor_config

from stapo_jax.algo.objectives import POLICY_LOSSES, PolicyLossConfig, PolicyLossInputs, safe_divide
from stapo_jax.algo.policy_losses.gspo import compute_policy_loss_gspo
from stapo_jax.config.recipes import recipe_from_config
from stapo_jax.config.schema import from_dict
from stapo_jax.core.errors import ConfigError

B, T = 6, 7
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def inputs(seed: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float64)
    mask[2] = 0.0  # an empty response
    lp = rng.normal(size=(B, T)) * 0.6 - 1.5
    old = lp + rng.normal(size=(B, T)) * 0.3
    old[4] = lp[4] - 0.5  # a sequence ratio e^0.5 > 1.28: clipped on a positive advantage
    adv = np.repeat(rng.normal(size=(B, 1)), T, axis=1)
    adv[4] = 1.0
    return lp, old, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_gspo_matches_verl(mode):
    lp, old, adv, mask = inputs(1)
    config = verl_actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28)
    t_lp = torch.tensor(lp, requires_grad=True)
    v_t, m_t = core_algos.compute_policy_loss_gspo(torch.tensor(old), t_lp, torch.tensor(adv), torch.tensor(mask),
                                                   loss_agg_mode=mode, config=config)
    v_t.backward()
    cfg = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode)
    with jax.enable_x64(True):
        def f(x):
            s, d, m = compute_policy_loss_gspo(PolicyLossInputs(jnp.asarray(old), x, jnp.asarray(adv),
                                                                jnp.asarray(mask)), cfg)
            return safe_divide(s, d), m

        (v_o, m_o), g_o = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    assert abs(float(v_o) - float(v_t.detach())) <= 1e-10 * max(1.0, abs(float(v_t.detach())))
    np.testing.assert_allclose(np.asarray(g_o), t_lp.grad.numpy(), atol=1e-10, rtol=1e-10)
    for name in ("pg_clipfrac", "ppo_kl"):  # verl's masked_mean divides by (count + 1e-8)
        s, w = (float(a) for a in m_o[name])
        assert abs(s / (w + 1e-8) - m_t[f"actor/{name}"]) <= 1e-10, name
    assert m_t["actor/pg_clipfrac"] > 0  # the fixture exercises the clip


def test_gspo_ratio_is_one_sequence_ratio_per_response():
    """Every valid token of a response carries the same ratio exp(mean log ratio); padding holds 0."""
    lp, old, adv, mask = inputs(2)
    with jax.enable_x64(True):
        _, _, _, pt = compute_policy_loss_gspo(PolicyLossInputs(jnp.asarray(old), jnp.asarray(lp), jnp.asarray(adv),
                                                                jnp.asarray(mask), return_per_token=True),
                                               PolicyLossConfig())
    ratio = np.asarray(pt["ratio"])
    for b in range(B):
        n = int(mask[b].sum())
        want = np.exp(((lp[b] - old[b]) * mask[b]).sum() / max(n, 1))
        np.testing.assert_allclose(ratio[b, :n], want, rtol=1e-12)
        assert np.all(ratio[b, n:] == 0)


def test_gspo_is_selected_from_yaml():
    assert POLICY_LOSSES["gspo"] is compute_policy_loss_gspo
    cfg = from_dict({"algorithm": {"recipe": "grpo"}, "actor": {"policy_loss": "gspo"}})
    assert recipe_from_config(cfg).policy_loss == "gspo"
    with pytest.raises(ConfigError, match=r"actor.policy_loss: 'gpso' is not a registered policy loss; did you mean "
                                          r"'gspo'\?"):
        from_dict({"actor": {"policy_loss": "gpso"}})
