"""The policy update as one unit (``train.policy_update.PolicyUpdate``, what the trainer's RL step and
``stapo-jax plan`` use): its call equals the update built by hand from ``make_update_steps`` + ``update_policy``
(bitwise parameters, optimizer state and metrics), its programs are built once per micro-batch count, and the
planner's spec builds the same object."""
import jax
import numpy as np
import optax
from flax import nnx
from test_update_donation import CFG, experience

from models.qwen3 import Qwen3
from stapo_jax.config.recipes import get_recipe
from stapo_jax.train.policy_update import PolicyUpdate
from stapo_jax.train.train_step import TrainState, make_log_prob_fn, make_update_steps
from stapo_jax.train.policy_update import update_policy


def test_policy_update_equals_the_update_built_by_hand():
    exp, opt = experience(), optax.adamw(1e-2)
    recipe = get_recipe("stapo").replace(s2t={"minibatch_method": "prepass"})  # a first-mini-batch program too
    state = TrainState.create(Qwen3(CFG, rngs=nnx.Rngs(0)), opt)
    steps = make_update_steps(recipe, opt, seq_chunk=4, vocab_size=CFG.vocab_size)
    assert steps[0] is not steps[1]
    lp_fn = jax.jit(make_log_prob_fn(seq_chunk=4), static_argnums=(1, 4))
    ref, m_ref = update_policy(state, exp, steps, lp_fn, mini_rows=2)

    update = PolicyUpdate(recipe, opt, None, temperature=1.0, seq_chunk=4, vocab_chunk=None,
                          vocab_size=CFG.vocab_size, state_shardings=None, mini_rows=2, num_micro_batches=1,
                          donate=False)
    state = TrainState.create(Qwen3(CFG, rngs=nnx.Rngs(0)), opt)
    new, m = update(state, exp)
    assert update.last_micro_batches == 1 and update.programs(1) is update.programs(1)
    assert int(new.step) == 2 and m == m_ref and m["grad_norm"] > 0
    for a, b in zip(jax.tree.leaves((ref.params, ref.opt_state)), jax.tree.leaves((new.params, new.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_planner_builds_the_same_policy_update():
    """``plan_analytic.spec_policy_update`` gives the trainer's PolicyUpdate for the spec's recipe and settings."""
    from stapo_jax.tools.plan_analytic import spec_policy_update

    spec = {"optim": {"lr": 1e-6, "warmup_steps": 0, "weight_decay": 0.1, "clip_grad": 1.0, "betas": (0.9, 0.999),
                      "eps": 1e-8},
            "temperature": 0.7, "seq_chunk": None, "vocab_chunk": 32, "mini_batch_sequences": 8,
            "num_micro_batches": 2, "recipe": "stapo", "s2t_scope": "minibatch", "top_entropy_scope": "minibatch",
            "ppo_epochs": 2, "use_remove_padding": True, "max_sequences": 5}
    from stapo_jax.tools.plan_analytic import spec_recipe

    update = spec_policy_update(spec, CFG, None, None)
    assert isinstance(update, PolicyUpdate) and update.recipe == spec_recipe(spec)
    assert (update.mini_rows, update.num_micro_batches, update.common) == (
        8, 2, {"temperature": 0.7, "seq_chunk": 512, "vocab_chunk": 32})
    assert (update.ppo_epochs, update.packed, update.sequences_cap) == (2, True, 5)
    assert spec_policy_update(spec, CFG, None, None, seq_chunk=6, vocab_chunk=None).common["seq_chunk"] == 6
