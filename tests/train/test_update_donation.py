"""The trainer's update with donated state (``make_train_step(donate=True)``, as ``trainer.train`` builds it):
the same parameters, optimizer state and metrics as without donation over two mini-batches, and the state it
was given is consumed (its buffers deleted) rather than kept as a second copy."""
import types

import jax
import numpy as np
import optax
from flax import nnx

from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.config.recipes import get_recipe
from stapo_jax.train.train_step import make_update_steps
from stapo_jax.train.batching import pack_prompt_response
from stapo_jax.train.train_step import TrainState, make_log_prob_fn
from stapo_jax.train.policy_update import update_policy

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64, initializer_range=0.5)


def experience(seed=0, b=4):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 64, 3)) for _ in range(b)]
    responses = [list(rng.integers(1, 64, n)) for n in (5, 3, 6, 2)]
    arrays = dict(pack_prompt_response(prompts, responses, pad_id=0, pad_multiple=1, response_length=6))
    arrays["advantages"] = np.where(arrays["response_mask"], rng.normal(size=(b, 1)), 0).astype(np.float32)
    return types.SimpleNamespace(arrays=arrays, num_rows=b)


def test_donated_update_equals_undonated_and_consumes_the_state():
    exp = experience()
    opt = optax.adamw(1e-2)
    recipe = get_recipe("stapo")
    lp_fn = jax.jit(make_log_prob_fn(seq_chunk=4), static_argnums=(1, 4))
    out = {}
    for donate in (False, True):
        state = TrainState.create(Qwen3(CFG, rngs=nnx.Rngs(0)), opt)
        old_leaves = jax.tree.leaves((state.params, state.opt_state))
        steps = make_update_steps(recipe, opt, seq_chunk=4, vocab_size=CFG.vocab_size, donate=donate)
        new, m = update_policy(state, exp, steps, lp_fn, mini_rows=2)
        assert int(new.step) == 2
        deleted = [x.is_deleted() for x in old_leaves]
        assert all(deleted) if donate else not any(deleted)
        out[donate] = (jax.tree.map(np.asarray, (new.params, new.opt_state)), m)
    for a, b in zip(jax.tree.leaves(out[False][0]), jax.tree.leaves(out[True][0])):
        np.testing.assert_array_equal(a, b)
    assert out[False][1] == out[True][1]
    assert out[True][1]["grad_norm"] > 0 and all(isinstance(v, float) for v in out[True][1].values())
