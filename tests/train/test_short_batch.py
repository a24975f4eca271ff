"""A rollout batch shorter than whole mini-batches (DAPO dynamic sampling that stops at
``sampling.max_gen_batches`` with fewer groups than asked for): ``experience.fill_mini_batches`` appends filler
rows, and the update on the filled batch equals the update on the real rows alone (fp32, 1e-6)."""
import types

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.config.recipes import get_recipe
from stapo_jax.train.batching import pack_prompt_response
from stapo_jax.train.experience import Experience, fill_mini_batches
from stapo_jax.train.train_step import TrainState, make_log_prob_fn, make_update_steps
from stapo_jax.train.policy_update import update_policy

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64, initializer_range=0.5)


def _experience(n=6, g=2, seed=5):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 64, 3)) for _ in range(n)]
    responses = [list(rng.integers(1, 64, int(k))) for k in rng.integers(1, 9, n)]
    arrays = dict(pack_prompt_response(prompts, responses, pad_id=0, pad_multiple=1, response_length=8))
    arrays["advantages"] = np.where(arrays["response_mask"], rng.normal(size=(n, 1)), 0).astype(np.float32)
    arrays["rollout_log_probs"] = np.where(arrays["response_mask"], -1.5, 0).astype(np.float32)
    return Experience(arrays=arrays, rewards=rng.random(n).astype(np.float32),
                      group_ids=(np.arange(n) // g).astype(np.int32), metrics={"reward/mean": 0.5})


def test_fillers_are_copies_without_response_tokens():
    exp = _experience(n=6)
    out = fill_mini_batches(exp, 8)
    a = out.arrays
    assert out.num_rows == 8 and out.filler_rows == 2 and out.metrics["sampling/filler_rows"] == 2.0
    np.testing.assert_array_equal(a["input_ids"][6:], exp.arrays["input_ids"][:2])
    np.testing.assert_array_equal(a["attention_mask"][6:], exp.arrays["attention_mask"][:2])
    assert not a["response_mask"][6:].any() and not a["advantages"][6:].any() and not a["rollout_log_probs"][6:].any()
    assert out.rewards[6:].tolist() == [0.0, 0.0] and out.group_ids[6:].tolist() == [-1, -1]
    for key in exp.arrays:  # the real rows and every dtype are kept
        np.testing.assert_array_equal(a[key][:6], exp.arrays[key])
        assert a[key].dtype == exp.arrays[key].dtype
    assert exp.num_rows == 6 and "sampling/filler_rows" not in exp.metrics  # the input is not modified
    # more fillers than real rows: copies cycle over the real rows; a full batch gets none
    assert fill_mini_batches(_experience(n=3), 8).arrays["input_ids"].shape[0] == 8
    full = fill_mini_batches(exp, 3)
    assert full.num_rows == 6 and full.filler_rows == 0 and full.metrics["sampling/filler_rows"] == 0.0


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="mini_rows=0"):
        fill_mini_batches(_experience(), 0)
    empty = Experience(arrays={}, rewards=np.zeros(0, np.float32), group_ids=np.zeros(0, np.int32), metrics={})
    with pytest.raises(ValueError, match="no rows"):
        fill_mini_batches(empty, 4)


@pytest.mark.parametrize("recipe_name", ["stapo", "grpo"])
def test_update_on_a_filled_batch_equals_the_update_on_its_real_rows(recipe_name):
    """6 real rows filled to one mini-batch of 8 (K=2) vs the 6 rows as their own mini-batch (K=2): the same
    parameters and the same metrics (STAPO's entropy quantile sees the same population, the loss the same
    denominator)."""
    exp = _experience(n=6)
    filled = fill_mini_batches(exp, 8)
    opt = optax.adamw(1e-2)
    recipe = get_recipe(recipe_name)
    lp_fn = jax.jit(make_log_prob_fn(seq_chunk=4, num_micro_batches=2), static_argnums=(1, 4))
    out = {}
    for name, e, rows in (("real", exp, 6), ("filled", filled, 8)):
        state = TrainState.create(Qwen3(CFG, rngs=nnx.Rngs(0)), opt)
        steps = make_update_steps(recipe, opt, num_micro_batches=2, seq_chunk=4, vocab_size=CFG.vocab_size)
        new, m = update_policy(state, types.SimpleNamespace(arrays=e.arrays, num_rows=e.num_rows), steps, lp_fn,
                               mini_rows=rows, num_micro_batches=2)
        out[name] = (jax.tree.map(np.asarray, new.params), m)
    moved = 0.0
    for x, y, x0 in zip(jax.tree.leaves(out["real"][0]), jax.tree.leaves(out["filled"][0]),
                        jax.tree.leaves(nnx.split(Qwen3(CFG, rngs=nnx.Rngs(0)))[1])):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
        moved = max(moved, float(np.abs(np.asarray(x0) - x).max()))
    assert moved > 1e-4  # the update did change the parameters
    real, filled = out["real"][1], out["filled"][1]
    assert real["loss_denominator"] == filled["loss_denominator"] > 0
    for k, v in real.items():  # every metric (token counts, entropy threshold, phase fractions, loss) agrees
        assert filled[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_a_dynamic_sampling_run_that_stops_short_trains_on_filler_completed_mini_batches(tmp_path):
    """The soak's configuration 4 (seed 0) that stopped with 'token_budget_slots: 8 rows in mini-batches of 20':
    DAPO dynamic sampling with ``sampling.max_gen_batches=2`` keeps fewer groups than a mini-batch; the run now
    completes its steps, records the filler rows and counts only real tokens."""
    from fixtures_trainer import metric_rows, run_cli

    run_dir = tmp_path / "run"
    r = run_cli("train", "--config", "configs/tiny_cpu.yaml", "data.gym.size=96", "data.gym.val_size=0",
                "reward.num_workers=1", "trainer.save_every=0", "trainer.export_hf=false", "sft.steps=4",
                "sft.lr=1.0e-2", "sft.batch_size=16", "algorithm.recipe=grpo", "rollout.n=2", "rollout.max_new_tokens=3",
                "trainer.train_batch_size=10", "actor.ppo_mini_batch_size=10", "actor.ppo_micro_batch_size=1",
                "trainer.total_steps=1", "sampling.dynamic=true", "sampling.max_gen_batches=2",
                "algorithm.strict_recipe=false", f"trainer.run_dir={run_dir}", devices=4, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = metric_rows(run_dir)
    real_rows = 2 * row["sampling/prompts"]
    assert 0 < real_rows < 20 and row["sampling/filler_rows"] == 20 - real_rows
    assert row["perf/response_tokens"] <= real_rows * 3  # filler rows are not counted as work
