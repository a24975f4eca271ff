"""The train step's mask strategy interface: a mask registered from outside the package runs through the generic
step (``stapo_jax.train.train_step``, unchanged) and gives the update of the same loss on a batch from which the
dropped tokens were removed; a strategy registered for it (the full-batch one) gives the same update."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train_step import CFG, SGD, make_batch

from models.qwen3 import Qwen3
from stapo_jax.algo import masks
from stapo_jax.config.recipes import get_recipe
from stapo_jax.train import mask_strategy as ms
from stapo_jax.train.train_step import TrainState, make_train_step


def positive_only(advantages, response_mask):
    """Keep the valid tokens of rows with A > 0; threshold 0."""
    keep = response_mask.astype(bool) & (advantages[:, None] > 0)
    return keep, jnp.zeros((), jnp.float32)


def update(model, recipe, batch):
    state = TrainState.create(model, SGD)
    new, m = make_train_step(recipe, SGD, num_micro_batches=2, seq_chunk=4)(state, batch)
    return [np.asarray(a) - np.asarray(b) for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params))], m


def test_custom_mask_through_generic_step():
    model = Qwen3(CFG, rngs=nnx.Rngs(0))
    batch = make_batch(model, seed=1)
    masks.register_token_mask("positive_only", needs=("advantages",), settings=(), population="valid tokens")(
        positive_only)
    try:
        recipe = get_recipe("grpo", token_mask="positive_only")
        assert ms.mask_strategy(recipe, has_old_entropy=False) is not None
        d_mask, m_mask = update(model, recipe, batch)
        ms.register_mask_strategy("positive_only")(lambda r, has_old: ms.full_batch_strategy(ms.prepass_stats))
        d_full, m_full = update(model, recipe, batch)
    finally:
        masks.TOKEN_MASKS.pop("positive_only", None)
        ms.MASK_STRATEGIES.pop("positive_only", None)
    kept = batch.response_mask * (batch.advantages[:, None] > 0)
    d_ref, m_ref = update(model, get_recipe("grpo"), dataclasses.replace(batch, response_mask=kept))
    assert 0 < float(m_mask["loss_denominator"]) == float(kept.sum()) < float(batch.response_mask.sum())
    assert float(m_mask["grad_norm"]) > 0
    for name in ("loss", "loss_denominator", "grad_norm", "pg_clipfrac"):
        np.testing.assert_allclose(float(m_mask[name]), float(m_ref[name]), rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(float(m_full[name]), float(m_mask[name]), rtol=1e-6, err_msg=name)
    for a, b, c in zip(d_mask, d_ref, d_full):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(a, c, atol=1e-7, rtol=1e-6)


def test_the_train_steps_surrogate_is_the_recipes_registered_policy_loss():
    """masked_policy_loss looks the loss up by the recipe's ``policy_loss`` name (objectives.POLICY_LOSSES, as
    verl's register_policy_loss): a registered loss is what the step differentiates; an unknown name is refused."""
    from stapo_jax.algo.objectives import POLICY_LOSSES, compute_policy_loss, register_policy_loss
    from stapo_jax.config.recipes import get_recipe
    from stapo_jax.train.train_step import masked_policy_loss
    from stapo_jax.train.train_step import Batch

    @register_policy_loss("doubled_for_test")
    def doubled(*args, **kwargs):
        s, d, m = compute_policy_loss(*args, **kwargs)
        return 2.0 * s, d, m

    try:
        lp = jnp.array([[-1.0, -0.5, -2.0]])
        mb = Batch(input_ids=jnp.zeros((1, 4), jnp.int32), attention_mask=jnp.ones((1, 4), bool),
                   response_mask=jnp.array([[1, 1, 0]]), advantages=jnp.array([1.0]),
                   old_log_probs=jnp.array([[-1.2, -0.5, -2.0]]))
        vanilla = masked_policy_loss(get_recipe("grpo"))(lp, None, mb, None)[0]
        custom = masked_policy_loss(get_recipe("grpo", policy_loss="doubled_for_test"))(lp, None, mb, None)[0]
        assert float(vanilla) != 0 and float(custom) == pytest.approx(2 * float(vanilla), rel=1e-6)
    finally:
        POLICY_LOSSES.pop("doubled_for_test")
    with pytest.raises(ValueError, match="actor.policy_loss: 'doubled_for_test' is not a registered policy loss"):
        get_recipe("grpo", policy_loss="doubled_for_test")


def test_what_differs_per_mask_is_its_registry_entries():
    """The threshold's metric name, the diagnostics' tau_h, row reordering, the first mini-batch's recipe and the
    count metrics come from the mask's entries (masks.TokenMask, mask_strategy.MaskUpdateSpec), not its name."""
    from stapo_jax.algo.recipes import compute_token_mask
    from stapo_jax.train.train_step import make_update_steps
    from stapo_jax.train.micro_batches import balance_allowed

    assert masks.get_token_mask("s2t").metric_name == "s2t/tau_h"
    assert masks.get_token_mask("top_entropy").metric_name == "top_entropy/threshold"
    assert ms.count_metrics() == ("s2t/n_keep", "grad/bounds_violated", "s2t/correction_passes",
                                "s2t/corrected_tokens")
    masks.register_token_mask("positive_tau", needs=("advantages",), settings=(), population="valid tokens",
                              threshold_metric="positive/tau", entropy_threshold=True)(positive_only)
    try:
        recipe = get_recipe("grpo", token_mask="positive_tau")
        resp = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
        keep, stats = compute_token_mask(recipe, response_mask=resp, advantages=jnp.array([1.0, -1.0]))
        assert stats == {"positive/tau": 0.0} and keep.tolist() == [[True, True, False], [False, False, False]]
        # its threshold is the diagnostics' tau_h (entropy_threshold=True), whatever the entropies
        assert float(ms.diagnostic_tau_h(recipe, stats, jnp.ones((2, 3)), resp)) == 0.0
        assert float(ms.diagnostic_tau_h(get_recipe("grpo"), {}, jnp.ones((2, 3)), resp)) == 1.0
        assert not balance_allowed(recipe)  # no scope: each micro-batch is its own population

        @ms.register_mask_strategy("positive_tau", first_minibatch=lambda r: r.replace(s2t={"tau_p": 0.5}),
                                   count_metrics=("positive/n",))
        def make(r, has_old):
            return None

        spec = ms.MASK_STRATEGIES["positive_tau"]
        assert (spec.name, spec.make, spec.count_metrics) == ("positive_tau", make, ("positive/n",))
        # a strategy registered after import adds its counts (summed over mini-batches by the update)
        assert ms.count_metrics()[-1] == "positive/n"
        assert ms.first_minibatch_recipe(recipe).s2t.tau_p == 0.5 and recipe.s2t.tau_p != 0.5
        first, rest = make_update_steps(recipe, SGD, num_micro_batches=1, seq_chunk=4)
        assert first is not rest  # the first mini-batch runs the entry's recipe (not compiled here)
    finally:
        masks.TOKEN_MASKS.pop("positive_tau", None)
        ms.MASK_STRATEGIES.pop("positive_tau", None)
    stapo = get_recipe("stapo")
    assert ms.first_minibatch_recipe(stapo) is None  # correction mode: one step for every mini-batch
    assert ms.first_minibatch_recipe(stapo.replace(s2t={"minibatch_method": "prepass"})).s2t.stats_policy == "old"
