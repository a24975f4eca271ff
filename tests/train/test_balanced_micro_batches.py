"""Micro-batch balancing for packed updates (``packing.balanced_row_order``, ``micro_batches.balance_allowed``): rows
stay in their mini-batch and shard block, micro-batches get nearly equal token counts (fewer packed rows), and
the update with rows regrouped into variable-count slots equals the padded update (fp32, 1e-5)."""
import types

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.config.recipes import get_recipe
from stapo_jax.train.train_step import make_update_steps
from stapo_jax.train.batching import pack_prompt_response
from stapo_jax.train.packing import balanced_row_order, pack_micro_batches
from stapo_jax.train.train_step import TrainState, make_log_prob_fn
from stapo_jax.train.micro_batches import balance_allowed
from stapo_jax.train.policy_update import update_policy

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64, initializer_range=0.5)


def test_order_is_a_permutation_inside_each_shard_block_and_balances_tokens():
    lengths = np.array([40, 39, 38, 37, 3, 2, 2, 1, 30, 1, 1, 1, 29, 2, 2, 2])
    perm = balanced_row_order(lengths, mini_rows=8, num_micro_batches=2, num_shards=2)
    assert sorted(perm) == list(range(16))
    for start in range(0, 16, 4):  # shard blocks of 4 rows never mix
        assert set(perm[start:start + 4]) == set(range(start, start + 4))
    for start in range(0, 16, 4):
        block = lengths[perm[start:start + 4]]
        loads = [block[j::2].sum() for j in range(2)]
        naive = [lengths[start:start + 4][j::2].sum() for j in range(2)]
        assert max(loads) <= max(naive)
    worst = np.array([50, 1, 49, 1])  # strided: 99 | 2
    p = balanced_row_order(worst, mini_rows=4, num_micro_batches=2)
    assert sorted([worst[p][0::2].sum(), worst[p][1::2].sum()]) == [50, 51]


def test_order_rejects_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="num_micro_batches=3"):
        balanced_row_order(np.ones(8, int), mini_rows=8, num_micro_batches=3)
    with pytest.raises(ValueError, match="mini-batches of 3"):
        balanced_row_order(np.ones(8, int), mini_rows=3, num_micro_batches=1)


def test_balance_allowed_only_where_the_micro_batch_does_not_matter():
    assert balance_allowed(get_recipe("grpo")) and balance_allowed(get_recipe("stapo"))
    assert not balance_allowed(get_recipe("stapo").replace(s2t={"quantile_scope": "microbatch"}))
    assert not balance_allowed(get_recipe("grpo").replace(token_mask="clip_cov"))


def _experience(b=8):
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(1, 64, 3)) for _ in range(b)]
    responses = [list(rng.integers(1, 64, n)) for n in (12, 1, 11, 2, 12, 1, 10, 2)]  # long rows on even positions
    arrays = dict(pack_prompt_response(prompts, responses, pad_id=0, pad_multiple=1, response_length=12))
    arrays["advantages"] = np.where(arrays["response_mask"], rng.normal(size=(b, 1)), 0).astype(np.float32)
    return types.SimpleNamespace(arrays=arrays, num_rows=b)


def test_balanced_order_packs_fewer_rows():
    exp = _experience()
    a = exp.arrays
    r = a["response_mask"].shape[1]
    plain = pack_micro_batches(a["input_ids"], a["attention_mask"], r, num_micro_batches=2)
    perm = balanced_row_order(a["attention_mask"].sum(-1), mini_rows=8, num_micro_batches=2)
    balanced = pack_micro_batches(a["input_ids"][perm], a["attention_mask"][perm], r, num_micro_batches=2)
    assert balanced.input_ids.shape[0] < plain.input_ids.shape[0]


def test_variable_count_slots_update_equals_padded_update():
    """update_policy with ``slots`` (micro_batches.token_budget_micro_batches: at 1 sequence per padded micro-batch,
    K = 4 per mini-batch of 4, fewer micro-batches of variable sequence counts plus dummy slots) equals the padded
    update (use_remove_padding false, K = 4): parameters and every metric, the sampler / trainer log-prob gap
    included (fp32, 1e-5)."""
    from stapo_jax.train.micro_batches import token_budget_micro_batches

    exp = _experience()
    a = exp.arrays
    a["rollout_log_probs"] = np.where(a["response_mask"], -1.5, 0).astype(np.float32)
    kk, slots = token_budget_micro_batches(a["attention_mask"], mini_rows=4, num_micro_batches=4)
    assert kk < 4 and (slots < 0).any() and len(slots) % 2 == 0
    opt = optax.adamw(1e-2)
    recipe = get_recipe("stapo")
    out = {}
    for packed, k in ((False, 4), (True, kk)):
        lp_fn = jax.jit(make_log_prob_fn(seq_chunk=4, num_micro_batches=k), static_argnums=(1, 4))
        state = TrainState.create(Qwen3(CFG, rngs=nnx.Rngs(0)), opt)
        steps = make_update_steps(recipe, opt, num_micro_batches=k, seq_chunk=4, vocab_size=CFG.vocab_size)
        new, m = update_policy(state, exp, steps, lp_fn, mini_rows=4, num_micro_batches=k, use_remove_padding=packed,
                               slots=slots if packed else None)
        out[packed] = (jax.tree.map(np.asarray, new.params), m)
    for x, y in zip(jax.tree.leaves(out[False][0]), jax.tree.leaves(out[True][0])):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6)
    assert out[False][1]["grad_norm"] > 0 and out[False][1]["sampler_trainer/logp_diff_mean"] > 0
    assert out[True][1].keys() == out[False][1].keys()
    for k, v in out[False][1].items():
        if k != "s2t/correction_passes":   # a count of micro-batches
            assert abs(out[True][1][k] - v) <= 1e-5 * max(1.0, abs(v)), k
