"""Advantage estimators vs the verl-semantics PyTorch reference, plus the constant-group / G=1 rules."""

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

from stapo_jax.algo.advantages import (
    dr_grpo_advantages,  # noqa: E402
    compute_advantages,
    grpo_advantages,
    nonzero_variance_groups,
    overlong_reward_penalty,
    rloo_advantages,
)


def fixture(seed=0):
    rng = np.random.default_rng(seed)
    # groups of sizes 4, 1 (single sample), 3 (constant), 5; rows shuffled
    groups = np.array([0] * 4 + [1] + [2] * 3 + [3] * 5)
    rewards = rng.normal(size=groups.size)
    rewards[groups == 2] = 0.7
    perm = rng.permutation(groups.size)
    return rewards[perm], groups[perm]


def test_grpo_matches_verl_reference_float64():
    r, g = fixture()
    with jax.enable_x64(True):
        v = dict(single_sample="verl")  # parity sets the convention explicitly (conventions.md §4)
        ours = np.asarray(grpo_advantages(jnp.asarray(r), jnp.asarray(g), **v))
        dr = np.asarray(grpo_advantages(jnp.asarray(r), jnp.asarray(g), norm_adv_by_std_in_grpo=False, **v))
        rl = np.asarray(rloo_advantages(jnp.asarray(r), jnp.asarray(g), **v))
        default = [np.asarray(f(jnp.asarray(r), jnp.asarray(g))) for f in (grpo_advantages, dr_grpo_advantages,
                                                                           rloo_advantages)]
    theirs = ref.grpo_advantage(torch.tensor(r), list(g)).numpy()
    # verl leaves a rounding residue (mean of equal floats / 1e-6, here ~1e-10) on constant groups; we give 0
    const = g == 2
    assert np.all(np.abs(theirs[const]) < 1e-9)
    np.testing.assert_allclose(ours[~const], theirs[~const], atol=1e-10)
    np.testing.assert_allclose(dr, ref.grpo_advantage(torch.tensor(r), list(g), norm_adv_by_std_in_grpo=False).numpy(),
                               atol=1e-10)
    np.testing.assert_allclose(rl, ref.rloo_advantage(torch.tensor(r), list(g)).numpy(), atol=1e-10)
    # single-sample group: R / (1 + eps); constant group: exactly 0
    single = g == 1
    np.testing.assert_allclose(ours[single], r[single] / (1 + 1e-6), rtol=1e-12)
    assert np.all(ours[g == 2] == 0.0) and np.all(rl[g == 2] == 0.0) and np.all(dr[g == 2] == 0.0)
    # default (the rule): single-sample and constant groups get exactly 0; other groups as verl
    for d, verl_like in zip(default, (ours, dr, rl)):
        assert np.all(d[single] == 0.0) and np.all(d[g == 2] == 0.0)
        np.testing.assert_array_equal(d[~single], verl_like[~single])


def test_grpo_by_hand_and_ddof():
    r = jnp.array([1.0, 0.0, 0.0, 0.0])
    g = jnp.zeros(4, jnp.int32)
    std1 = np.std([1, 0, 0, 0], ddof=1)
    np.testing.assert_allclose(np.asarray(grpo_advantages(r, g)), (np.array([1, 0, 0, 0]) - 0.25) / (std1 + 1e-6),
                               rtol=1e-6)
    std0 = np.std([1, 0, 0, 0])
    np.testing.assert_allclose(np.asarray(grpo_advantages(r, g, ddof=0)), (np.array([1, 0, 0, 0]) - 0.25) / (std0 + 1e-6),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rloo_advantages(r, g)), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-6)


def test_jit_with_static_num_groups_and_dispatch():
    r, g = fixture(1)
    f = jax.jit(lambda r, g: compute_advantages("grpo", r, g, num_groups=4, single_sample="verl"))
    np.testing.assert_allclose(np.asarray(f(jnp.asarray(r, jnp.float32), jnp.asarray(g))),
                               ref.grpo_advantage(torch.tensor(r, dtype=torch.float32), list(g)).numpy(), atol=1e-5)
    with pytest.raises(ValueError, match="'ppo' is not a registered advantage estimator"):
        compute_advantages("ppo", r, g)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(jnp.zeros(3), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(jnp.zeros((3, 2)), jnp.zeros(3, jnp.int32))


def test_dapo_hooks():
    r = jnp.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    g = jnp.array([0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(np.asarray(nonzero_variance_groups(r, g)), [False, False, True, True, False, False])
    pen = overlong_reward_penalty(jnp.array([100, 16384, 18432, 20480]), max_response_length=20480,
                                  overlong_buffer_len=4096, penalty_factor=1.0)
    np.testing.assert_allclose(np.asarray(pen), [0.0, 0.0, -0.5, -1.0])
    assert np.all(np.asarray(overlong_reward_penalty(jnp.array([5, 50]), max_response_length=10,
                                                     overlong_buffer_len=0)) == 0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_reward_penalty(jnp.array([1]), max_response_length=10, overlong_buffer_len=20)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, -1.0, 0.5])), min_size=1, max_size=12))
def test_never_nan_and_constant_groups_zero(rows):
    g = np.array([x[0] for x in rows])
    r = np.array([x[1] for x in rows])
    for name in ("grpo", "dr_grpo", "rloo"):
        a = np.asarray(compute_advantages(name, jnp.asarray(r, jnp.float32), jnp.asarray(g)))
        assert np.all(np.isfinite(a))
        for grp in np.unique(g):
            sel = g == grp
            if sel.sum() > 1 and np.all(r[sel] == r[sel][0]):
                assert np.all(a[sel] == 0.0)


def test_estimators_and_losses_are_registered_by_name():
    from stapo_jax.algo.advantages import ADVANTAGE_ESTIMATORS, register_adv_est
    from stapo_jax.algo.objectives import POLICY_LOSSES, compute_policy_loss, register_policy_loss

    assert sorted(ADVANTAGE_ESTIMATORS) == ["dr_grpo", "grpo", "rloo"] and POLICY_LOSSES["vanilla"] is compute_policy_loss
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda r, g: r)
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("vanilla")(compute_policy_loss)
    r, g = jnp.array([1.0, 0.0, 1.0, 1.0]), jnp.array([7, 7, -3, -3])  # any integer uids
    np.testing.assert_allclose(np.asarray(compute_advantages("rloo", r, g)), [1.0, -1.0, 0.0, 0.0])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_half_precision_rewards_keep_their_variance(dtype, name):
    """Rewards of a few hundred in float16 square past its 65,504 maximum: the statistics are computed in float32
    (the advantages come back in the rewards' dtype), so they equal the float32 estimator's rounded, not inf/NaN."""
    r32 = jnp.asarray([300.0, 0.0, 260.0, -280.0, 500.0, 510.0], jnp.float32)  # exact in both half dtypes
    g = jnp.asarray([0, 0, 0, 0, 1, 1])
    half = compute_advantages(name, r32.astype(dtype), g)
    assert half.dtype == dtype
    want = np.asarray(compute_advantages(name, r32, g).astype(dtype).astype(jnp.float32))
    assert np.all(np.isfinite(want)) and np.abs(want).max() > 0.5
    np.testing.assert_array_equal(np.asarray(half.astype(jnp.float32)), want)


def test_grpo_negative_epsilon_is_an_error():
    """A negative (or NaN) epsilon could cancel a group's std and give +-inf advantages: refused, naming it;
    epsilon = 0 is allowed (the z-score without the guard)."""
    r, g = jnp.asarray([1.0, 0.0, 1.0, 1.0]), jnp.asarray([0, 0, 1, 1])
    for bad in (-0.7071067811865476, float("nan")):
        with pytest.raises(ValueError, match="epsilon must be >= 0"):
            grpo_advantages(r, g, epsilon=bad)
    np.testing.assert_allclose(np.asarray(grpo_advantages(r, g, epsilon=0.0)),
                               [0.70710678, -0.70710678, 0.0, 0.0], rtol=1e-6)
