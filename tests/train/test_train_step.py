"""The jitted update on a tiny Qwen3: K micro-batches == full batch (value and update) for every aggregation
mode and for the S2T / 20-Entropy masks with unequal lengths; 8-device data parallel == 1 device; the first
mini-batch ratio is 1; empty batches give a finite zero update; a non-finite gradient skips the update."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from models.sharding import make_mesh
from stapo_jax.algo.advantages import grpo_advantages
from stapo_jax.train.batching import pack_prompt_response
from stapo_jax.config.recipes import get_recipe
from stapo_jax.train.train_step import Batch, TrainState, make_log_prob_fn, make_train_step

CFG = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, max_position_embeddings=64, initializer_range=0.5)
SGD = optax.sgd(1.0)  # new params - old params = -gradient


def make_batch(model, seed=0, b=8, ratio_noise=0.3):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, 64, rng.integers(1, 4))) for _ in range(b)]
    responses = [list(rng.integers(1, 64, n)) for n in rng.integers(0, 7, b)]  # unequal, one may be empty
    responses[1] = []
    packed = pack_prompt_response(prompts, responses, pad_id=0, pad_multiple=1, response_length=6)
    rewards = rng.choice([0.0, 1.0], b)
    rewards[:2] = [1.0, 0.0]
    adv = grpo_advantages(jnp.asarray(rewards, jnp.float32), jnp.repeat(jnp.arange(b // 4), 4))
    graphdef, params = nnx.split(model)
    lp, _ = make_log_prob_fn()(params, graphdef, jnp.asarray(packed["input_ids"]),
                               jnp.asarray(packed["attention_mask"]), 6)
    old = lp + jnp.asarray(rng.normal(size=lp.shape) * ratio_noise, jnp.float32)
    return Batch(input_ids=jnp.asarray(packed["input_ids"]), attention_mask=jnp.asarray(packed["attention_mask"]),
                 response_mask=jnp.asarray(packed["response_mask"]), advantages=adv, old_log_probs=old)


@pytest.fixture(scope="module")
def model():
    return Qwen3(CFG, rngs=nnx.Rngs(0))


def run(model, recipe, batch, k, **kw):
    state = TrainState.create(model, SGD)
    step = make_train_step(recipe, SGD, num_micro_batches=k, seq_chunk=4, **kw)
    new, m = step(state, batch)
    delta = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new.params, state.params)
    return delta, {n: float(v) for n, v in m.items()}


# every aggregation mode x mask is covered without a model in test_objectives.py
# (test_micro_batch_accumulation_is_exact); here the full update, with both population masks
CASES = [
    ("stapo", "seq-mean-token-mean"),
    ("entropy20", "seq-mean-token-sum-norm"),
]


@pytest.mark.parametrize("name,mode", CASES)
def test_micro_batches_equal_full_batch(model, name, mode):
    recipe = get_recipe(name, loss={"loss_agg_mode": mode}, s2t={"tau_p": 0.05})
    batch = make_batch(model)
    d1, m1 = run(model, recipe, batch, 1)
    d4, m4 = run(model, recipe, batch, 2)
    assert abs(m1["loss"] - m4["loss"]) < 1e-5 * max(1.0, abs(m1["loss"]))
    assert m1["loss_denominator"] == m4["loss_denominator"]
    for a, b in zip(jax.tree.leaves(d1), jax.tree.leaves(d4)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
    assert m1["grad_norm"] > 0
    if name == "stapo":
        assert m1["s2t/masked_frac"] > 0 and m1["s2t/masked_frac"] == m4["s2t/masked_frac"]
        assert m1["s2t/n_keep"] == m4["s2t/n_keep"] == m1["loss_denominator"] or mode != "token-mean"
    if name == "entropy20":
        n_valid = float(batch.response_mask.sum())
        assert m1["s2t/masked_frac"] == pytest.approx(1 - max(1, int(n_valid * 0.2 + 0.9999)) / n_valid)


def test_first_minibatch_ratio_is_one(model):
    batch = make_batch(model, seed=1, ratio_noise=0.0)
    _, m = run(model, get_recipe("stapo"), batch, 2)
    assert abs(m["ratio_mean"] - 1.0) < 1e-6 and abs(m["ppo_kl"]) < 1e-6 and m["pg_clipfrac"] == 0.0


def test_empty_batch_zero_update(model):
    batch = make_batch(model, seed=2)
    batch = batch.replace(response_mask=jnp.zeros_like(batch.response_mask))
    d, m = run(model, get_recipe("stapo"), batch, 2)
    assert m["loss"] == 0.0 and m["grad_norm"] == 0.0 and m["nonfinite_grad"] == 0.0
    assert all(np.all(x == 0) for x in jax.tree.leaves(d))
    assert all(np.isfinite(v) for v in m.values())


def test_eight_device_data_parallel_equals_one_device(model):
    assert jax.device_count() == 8
    recipe = get_recipe("stapo", s2t={"tau_p": 0.05})
    batch = make_batch(model, seed=3, b=16)
    d1, m1 = run(model, recipe, batch, 2)
    mesh = make_mesh(data=4, fsdp=2)
    state = TrainState.create(model, SGD, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step = make_train_step(recipe, SGD, num_micro_batches=2, seq_chunk=4, mesh=mesh, state_shardings=shardings)
    new, m8 = step(state, batch)
    assert abs(float(m8["loss"]) - m1["loss"]) < 1e-5
    assert float(m8["s2t/n_keep"]) == m1["s2t/n_keep"]
    for a, b, c in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), jax.tree.leaves(d1)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), c, atol=1e-5, rtol=1e-4)


def test_bad_batch_names_field(model):
    batch = make_batch(model)
    with pytest.raises(ValueError, match="old_log_probs"):
        run(model, get_recipe("grpo"), batch.replace(old_log_probs=batch.old_log_probs[:, :3]), 1)
    with pytest.raises(ValueError, match="num_micro_batches"):
        run(model, get_recipe("grpo"), batch, 3)


def with_old_entropy(model, batch, noise, seed=0):
    """The batch plus ``old_entropy``: the current policy's entropies, plus ``noise`` (a stand-in for the drift of
    pi_theta away from pi_old over the earlier mini-batches of a step)."""
    graphdef, params = nnx.split(model)
    _, ent = make_log_prob_fn()(params, graphdef, batch.input_ids, batch.attention_mask, 6)
    rng = np.random.default_rng(seed)
    return batch.replace(old_entropy=ent + jnp.asarray(rng.normal(size=ent.shape) * noise, jnp.float32))


@pytest.mark.parametrize("mode,k", [("token-mean", 2), ("seq-mean-token-mean", 1), ("seq-mean-token-sum", 4)])
def test_s2t_correction_equals_prepass(model, mode, k):
    """minibatch_method='correction' (provisional tau_h from old_entropy, then redo the micro-batches whose mask
    the exact tau_h changes) gives the pre-pass update, even when the provisional threshold is far off."""
    batch = with_old_entropy(model, make_batch(model, seed=4), noise=1.0)
    s2t = {"tau_p": 0.05}
    d_pre, m_pre = run(model, get_recipe("stapo", loss={"loss_agg_mode": mode},
                                         s2t={**s2t, "minibatch_method": "prepass"}), batch, k)
    d_cor, m_cor = run(model, get_recipe("stapo", loss={"loss_agg_mode": mode}, s2t=s2t), batch, k)
    assert m_cor["s2t/correction_passes"] >= 1 and m_cor["s2t/corrected_tokens"] >= 1  # the fix-up did run
    assert "s2t/correction_passes" not in m_pre
    for name in ("loss", "loss_denominator", "s2t/n_keep", "s2t/masked_frac", "s2t/tau_h", "pg_clipfrac"):
        assert m_cor[name] == pytest.approx(m_pre[name], rel=1e-5, abs=1e-6), name
    assert m_pre["s2t/masked_frac"] > 0
    for a, b in zip(jax.tree.leaves(d_pre), jax.tree.leaves(d_cor)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-4)
    # a provisional threshold that is wrong, but not corrected, would give a different update
    d_bad, m_bad = run(model, get_recipe("stapo", loss={"loss_agg_mode": mode},
                                         s2t={**s2t, "stats_policy": "old"}), batch, k)
    assert m_bad["s2t/tau_h"] != pytest.approx(m_pre["s2t/tau_h"], rel=1e-3)


def test_s2t_correction_needs_no_pass_on_policy(model):
    """With old_entropy from the current parameters (the first mini-batch of a step) nothing is redone."""
    batch = with_old_entropy(model, make_batch(model, seed=5), noise=0.0)
    recipe = get_recipe("stapo", s2t={"tau_p": 0.05})
    d_cor, m_cor = run(model, recipe, batch, 2)
    d_pre, m_pre = run(model, recipe, batch.replace(old_entropy=None), 2)  # no old statistics: the pre-pass
    assert m_cor["s2t/correction_passes"] == 0 and m_cor["s2t/corrected_tokens"] == 0
    assert m_cor["s2t/n_keep"] == m_pre["s2t/n_keep"] and m_pre["s2t/masked_frac"] > 0
    for a, b in zip(jax.tree.leaves(d_pre), jax.tree.leaves(d_cor)):
        np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-5)


def test_s2t_correction_eight_devices_equals_one(model):
    assert jax.device_count() == 8
    recipe = get_recipe("stapo", s2t={"tau_p": 0.05})
    batch = with_old_entropy(model, make_batch(model, seed=6, b=16), noise=1.0)
    d1, m1 = run(model, recipe, batch, 2)
    mesh = make_mesh(data=4, fsdp=2)
    state = TrainState.create(model, SGD, mesh)
    step = make_train_step(recipe, SGD, num_micro_batches=2, seq_chunk=4, mesh=mesh,
                           state_shardings=jax.tree.map(lambda x: x.sharding, state))
    new, m8 = step(state, batch)
    assert m1["s2t/correction_passes"] >= 1 and float(m8["s2t/correction_passes"]) == m1["s2t/correction_passes"]
    assert float(m8["s2t/n_keep"]) == m1["s2t/n_keep"]
    for a, b, c in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), jax.tree.leaves(d1)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(b), c, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("token_mask", ["clip_cov", "kl_cov"])
def test_cov_recipes_end_to_end(model, token_mask):
    """Clip-Cov / KL-Cov through the jitted update equal the loss written out directly: log-probs of the model,
    the selection on stop-gradient inputs (Clip-Cov with the step's PRNG key), verl's surrogate, one division;
    and the selection changes the update (it is not silently dropped)."""
    from stapo_jax.algo.objectives import PolicyLossInputs, compute_policy_loss
    from stapo_jax.train.policy import response_log_probs_and_entropy
    from stapo_jax.algo.recipes import compute_token_mask

    recipe = get_recipe("justrl").replace(token_mask=token_mask, cov={"clip_cov_ratio": 0.3, "clip_cov_lb": -5.0,
                                                                      "clip_cov_ub": 50.0, "kl_cov_ratio": 0.3})
    batch = make_batch(model, seed=7)
    d_step, m = run(model, recipe, batch, 1)
    graphdef, params = nnx.split(model)
    resp = batch.response_mask.astype(jnp.float32)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), 0), 0)  # the step's key, micro-batch 0

    def loss(p):
        lp, ent = response_log_probs_and_entropy(nnx.merge(graphdef, p), batch.input_ids, batch.attention_mask, 6,
                                                 seq_chunk=4)
        sel, _ = compute_token_mask(recipe, log_probs=jax.lax.stop_gradient(lp), entropy=jax.lax.stop_gradient(ent),
                                    advantages=batch.advantages, response_mask=resp,
                                    old_log_probs=batch.old_log_probs, key=key)
        kl = token_mask == "kl_cov"
        s, d, _ = compute_policy_loss(PolicyLossInputs(batch.old_log_probs, lp, batch.advantages, resp,
                                                       None if kl else sel, entropy=ent,
                                                       kl_cov_selection=sel if kl else None,
                                                       renormalize=recipe.renormalize), recipe.loss)
        return s / d, jnp.sum(sel & (resp > 0))

    (value, n_sel), g = jax.value_and_grad(loss, has_aux=True)(params)
    assert int(n_sel) > 0
    assert m["loss"] == pytest.approx(float(value), rel=1e-5)
    for a, b in zip(jax.tree.leaves(d_step), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, -np.asarray(b), atol=1e-5, rtol=1e-4)
    d_plain, _ = run(model, get_recipe("justrl"), batch, 1)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(d_step), jax.tree.leaves(d_plain))) > 1e-4


@pytest.mark.parametrize("s2t", [{"minibatch_method": "prepass"}, {}, {"quantile_scope": "microbatch"}])
def test_s2t_tau_h_metric_is_the_threshold_the_mask_used(model, s2t):
    """With quantile_tokens='positive_adv' the reported tau_h (and the phase cells) use the mask's own
    population, not all valid tokens (the pre-pass path used to report the all-token quantile)."""
    batch = with_old_entropy(model, make_batch(model, seed=8), noise=0.0)
    recipe = get_recipe("stapo", s2t={"tau_p": 0.05, "quantile_tokens": "positive_adv", **s2t})
    _, m = run(model, recipe, batch, 1)
    graphdef, params = nnx.split(model)
    _, ent = make_log_prob_fn()(params, graphdef, batch.input_ids, batch.attention_mask, 6)
    pos = np.asarray(batch.response_mask, bool) & (np.asarray(batch.advantages)[:, None] > 0)
    expected = np.quantile(np.asarray(ent)[pos], 0.8)
    everyone = np.quantile(np.asarray(ent)[np.asarray(batch.response_mask, bool)], 0.8)
    assert abs(expected - everyone) > 1e-3  # the two populations give different thresholds here
    assert m["s2t/tau_h"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nonfinite_gradient_skips_the_update_bitwise(dtype):
    """A non-finite gradient leaves parameters, AdamW moments and the step counter exactly as they were (bf16
    moments come back as float32, the dtype the update gives them, as before); a finite one moves parameters and
    moments. The skip is a branch (``lax.cond``), so the donated update holds no copy of the moments (XLA:CPU
    copied every mu and nu buffer under a select of new against old values)."""
    model = Qwen3(dataclasses.replace(CFG, dtype=dtype, param_dtype=dtype), rngs=nnx.Rngs(0))
    adamw = optax.adamw(1e-2, weight_decay=0.1)
    state = TrainState.create(model, adamw)
    batch = make_batch(model, seed=3)
    step = make_train_step(get_recipe("grpo"), adamw, seq_chunk=4)
    bad = batch.replace(advantages=batch.advantages.at[0].set(jnp.inf))
    new, m = step(state, bad)
    assert float(m["nonfinite_grad"]) == 1.0 and int(new.step) == int(state.step) == 0
    for a, b in zip(jax.tree.leaves((new.params, new.opt_state)), jax.tree.leaves((state.params, state.opt_state)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert jax.tree.leaves(new.params)[0].dtype == jnp.dtype(dtype)
    good, m = step(state, batch)
    assert float(m["nonfinite_grad"]) == 0.0 and int(good.step) == 1
    moved = [not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves((good.params, good.opt_state)),
                             jax.tree.leaves((state.params, state.opt_state)))]
    assert sum(moved) >= len(moved) // 2
    if dtype != "float32":
        return
    donated = make_train_step(get_recipe("grpo"), adamw, seq_chunk=4, donate=True)
    hlo = donated.lower(state, batch).compile().as_text()
    assert "parameter(" in hlo and not re.findall(r"copy\(%state_opt_state[\w.]*\)", hlo)


def _without_extra_args(opt):
    """``opt`` as a plain ``optax.GradientTransformation``: called without extra arguments, its clip computes its
    own norm."""
    return optax.GradientTransformation(opt.init, lambda u, s, p=None: opt.update(u, s, p))


def test_given_grad_norm_update_equals_the_plain_optax_path(model):
    """The step hands make_optimizer's chain the gradient norm it computed (``global_norm``), so the clip reads
    no gradient inside the update; the update equals, bitwise, that of the same optimizer as a plain
    ``optax.GradientTransformation`` (given no norm: its clip computes its own), with the clip active."""
    from stapo_jax.train.optim import make_optimizer

    clipped = make_optimizer(1e-2, warmup_steps=1, weight_decay=0.1, clip_grad=1e-3)
    plain = _without_extra_args(clipped)
    batch = make_batch(model, seed=5)
    outs = []
    for opt in (clipped, plain):
        state = TrainState.create(model, opt)
        step = make_train_step(get_recipe("stapo"), opt, num_micro_batches=2, seq_chunk=4)
        for _ in range(2):
            state, m = step(state, batch)
        outs.append((state, float(m["grad_norm"])))
    (a, norm_a), (b, norm_b) = outs
    assert norm_a == norm_b and norm_a > 1e-3  # the clip scaled the gradient down
    moved = 0
    for x, y in zip(jax.tree.leaves((a.params, a.opt_state)), jax.tree.leaves((b.params, b.opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, x0 in zip(jax.tree.leaves(a.params), jax.tree.leaves(nnx.split(model)[1]), strict=True):
        moved += not np.array_equal(np.asarray(x), np.asarray(x0))
    assert moved == len(jax.tree.leaves(a.params))


def test_a_user_chain_with_a_transformation_before_the_clip_gets_no_norm(model):
    """Only make_optimizer's clip-first optimizer (``GlobalNormClipped``) is given the step's gradient norm: a user
    chain that scales the gradient before our clip must clip by the norm of what the clip receives (the scaled
    gradient), i.e. exactly as the same chain computing its own norm."""
    from stapo_jax.train.optim import GlobalNormClipped, clip_by_global_norm

    batch = make_batch(model, seed=5)
    chain = optax.chain(optax.scale(2.0), clip_by_global_norm(1.0), optax.sgd(1.0))
    hidden = _without_extra_args(chain)
    assert not isinstance(chain, GlobalNormClipped)
    deltas = []
    for opt in (chain, hidden):
        state = TrainState.create(model, opt)
        new, m = make_train_step(get_recipe("grpo"), opt, seq_chunk=4)(state, batch)
        deltas.append(jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), new.params, state.params))
    assert float(m["grad_norm"]) > 0.5  # 2 x grad_norm > 1: the clip is active on the scaled gradient
    for x, y in zip(jax.tree.leaves(deltas[0]), jax.tree.leaves(deltas[1]), strict=True):
        np.testing.assert_array_equal(x, y)
    assert float(optax.tree.norm(deltas[0])) == pytest.approx(1.0, rel=1e-5)  # sgd(1) of the clipped gradient


@pytest.mark.parametrize("name,old_entropy", [("stapo", True), ("entropy20", False)])
def test_kl_term_over_valid_tokens_in_the_update(model, name, old_entropy):
    """KL under a token mask (verl's actor): the update is the gradient of pg / N_keep + beta * KL / N_valid on the
    whole mini-batch, for any number of micro-batches and with S2T's correction pass (the KL term is
    differentiated apart there: its denominator is not the kept-token count)."""
    from stapo_jax.algo.objectives import PolicyLossInputs, compute_policy_loss, safe_divide
    from stapo_jax.algo.recipes import compute_token_mask
    from stapo_jax.train.train_step import kl_apart
    from stapo_jax.train.policy import response_log_probs_and_entropy

    batch = make_batch(model, seed=6)
    batch = batch.replace(ref_log_probs=batch.old_log_probs + 0.3)
    if old_entropy:  # the correction strategy, with a provisional threshold that is off
        batch = with_old_entropy(model, batch, noise=1.0)
    recipe = get_recipe(name, loss={"use_kl_loss": True, "kl_loss_coef": 0.5}, s2t={"tau_p": 0.05},
                        top_entropy={"ratio": 0.5})
    assert kl_apart(recipe)
    graphdef, params = nnx.split(model)

    def whole(p):
        lp, ent = response_log_probs_and_entropy(nnx.merge(graphdef, p), batch.input_ids, batch.attention_mask, 6,
                                                 seq_chunk=4)
        keep, _ = compute_token_mask(recipe, log_probs=jax.lax.stop_gradient(lp),
                                     entropy=jax.lax.stop_gradient(ent), advantages=batch.advantages,
                                     response_mask=batch.response_mask.astype(jnp.float32))
        s, d, m = compute_policy_loss(PolicyLossInputs(batch.old_log_probs, lp, batch.advantages, batch.response_mask,
                                                       keep, entropy=ent, ref_log_probs=batch.ref_log_probs),
                                      recipe.loss)
        return safe_divide(s, d), (keep, m)

    (want_loss, (keep, m)), want_grad = jax.value_and_grad(whole, has_aux=True)(params)
    assert 0 < int(keep.sum()) < int(batch.response_mask.sum())  # the mask drops tokens: N_keep != N_valid
    kl_value = float(safe_divide(*m["kl_loss"]))
    assert float(m["kl_loss"][1]) == float(batch.response_mask.sum()) and kl_value > 0
    d, got = run(model, recipe, batch, 2)  # two micro-batches (test_micro_batches_equal_full_batch: any K)
    assert got["loss"] == pytest.approx(float(want_loss), rel=1e-5)
    assert got["kl_loss"] == pytest.approx(kl_value, rel=1e-5)
    if old_entropy:
        assert got["s2t/correction_passes"] >= 1
    for a, b in zip(jax.tree.leaves(d), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(a, -np.asarray(b), atol=1e-5, rtol=1e-4)
