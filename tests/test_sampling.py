"""Sampler tests: truncation equals transformers' logits warpers, sampled frequencies match the expected
distribution (chi-square), and the reported log-probs are the full-vocabulary temperature-scaled ones."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from stapo_jax.algo.logprobs import logits_to_log_probs
from stapo_jax.rollout.sampling import SamplingParams, SamplingParamsError, sample_tokens, truncate_logits

V = 8
LOGITS = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -0.4, -1.0, -2.5], np.float32)
N = 20000


def hf_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Expected sampling distribution from transformers' warpers (the order generate() applies them)."""
    scores = torch.tensor(logits, dtype=torch.float32)[None]
    ids = torch.zeros((1, 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores.double(), -1)[0].numpy()


def draw(params: SamplingParams, seed: int = 0) -> np.ndarray:
    keys = jax.random.split(jax.random.key(seed), N)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N, V))
    tokens, _ = jax.jit(sample_tokens, static_argnums=2)(logits, keys, params)
    return np.bincount(np.asarray(tokens), minlength=V)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts}"
    expected = probs[support] * counts.sum()
    return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(0.7, 0, 1.0), (1.3, 3, 1.0), (0.9, 0, 0.6), (1.5, 5, 0.8)],
)
def test_sampled_distribution_matches_hf_warpers(temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    counts = draw(params, seed=1)
    expected = hf_distribution(LOGITS, temperature, top_k, top_p)
    assert chi2_pvalue(counts, expected) > 1e-3
    # The test has power: the untruncated T=1 distribution is rejected decisively.
    wrong = hf_distribution(LOGITS, 1.0, 0, 1.0)
    with np.errstate(divide="ignore"):
        assert stats.chisquare(counts, wrong * counts.sum()).pvalue < 1e-6


@pytest.mark.parametrize("top_k,top_p", [(0, 0.3), (4, 1.0), (7, 0.95), (20, 0.5), (0, 0.999)])
def test_truncation_equals_hf_warpers(top_k, top_p):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 20)).astype(np.float32) * 2.0
    ours = np.asarray(truncate_logits(jnp.asarray(logits), top_k, top_p))
    scores = torch.tensor(logits)
    ids = torch.zeros((6, 1), dtype=torch.long)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(scores.numpy()))
    np.testing.assert_array_equal(ours[np.isfinite(ours)], scores.numpy()[np.isfinite(ours)])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.6, top_p=0.5, top_k=3), SamplingParams(1.7)])
def test_log_probs_are_full_vocab_temperature_scaled(params):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 50)).astype(np.float32) * 3
    keys = jax.random.split(jax.random.key(7), 64)
    tokens, log_probs = sample_tokens(jnp.asarray(logits), keys, params)
    ref = torch.log_softmax(torch.tensor(logits) / params.temperature, -1)
    ref = ref.gather(-1, torch.tensor(np.asarray(tokens), dtype=torch.long)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(log_probs), ref, atol=1e-5)
    assert log_probs.dtype == jnp.float32 and tokens.dtype == jnp.int32


def test_greedy_is_argmax_and_keys_make_draws_deterministic():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(16, 30)).astype(np.float32))
    keys = jax.random.split(jax.random.key(0), 16)
    tok, lp = sample_tokens(logits, keys, SamplingParams(temperature=0.5, greedy=True))
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
    ref = torch.log_softmax(torch.tensor(np.asarray(logits)) / 0.5, -1).max(-1).values.numpy()
    np.testing.assert_allclose(np.asarray(lp), ref, atol=1e-5)
    a, _ = sample_tokens(logits, keys, SamplingParams(1.0))
    b, _ = sample_tokens(logits, keys, SamplingParams(1.0))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # A row's draw depends only on its own key: permuting rows permutes the draws.
    perm = np.arange(16)[::-1]
    c, _ = sample_tokens(logits[perm], keys[perm], SamplingParams(1.0))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(a)[perm])


@pytest.mark.parametrize(
    "kwargs,field",
    [({"temperature": 0.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
     ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k")],
)
def test_bad_sampling_params_raise(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_one_pass_greedy_and_sampled_log_probs_match_the_two_pass_reference():
    """The greedy path reuses the argmax's maximum for the log-sum-exp (no separate max pass, same float); the
    sampled path draws the same Gumbel-max tokens: both equal argmax / jax.random.categorical followed by
    logits_to_log_probs, bitwise, for a fixed key."""
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(6, 300)) * 4, jnp.float32)
    keys = jax.random.split(jax.random.key(3), 6)
    for params in (SamplingParams(greedy=True), SamplingParams(temperature=0.6, greedy=True),
                   SamplingParams(temperature=0.7), SamplingParams(temperature=1.0)):
        tok, lp = jax.jit(sample_tokens, static_argnums=2)(logits, keys, params)
        if params.greedy:
            ref_tok = jnp.argmax(logits, axis=-1)
        else:
            ref_tok = jax.vmap(jax.random.categorical)(keys, logits / params.temperature)
        ref_lp = jax.jit(logits_to_log_probs, static_argnums=2)(logits, ref_tok, params.temperature)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
        np.testing.assert_array_equal(np.asarray(lp), np.asarray(ref_lp))


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 1.0), (0, 0.9), (50, 0.8)])
def test_fused_draw_equals_categorical_and_log_probs_equal_the_trainers(temperature, top_k, top_p):
    """sample_tokens draws Gumbel-max over one shared temperature-scaled copy of the logits: for many keys its
    tokens are exactly jax.random.categorical's over the truncated logits (the pre-fusion sampler), and its
    log-probs are logits_to_log_probs' (the trainer's) within float rounding."""
    b, v = 256, 1000
    rng = np.random.default_rng(int(temperature * 10) + top_k)
    logits = jnp.asarray(rng.normal(size=(b, v)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(11 + top_k), b)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tok, lp = jax.jit(sample_tokens, static_argnums=2)(logits, keys, params)

    @jax.jit
    def reference(logits, keys):
        scaled = truncate_logits(logits / temperature, top_k, top_p)
        tokens = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return tokens, logits_to_log_probs(logits, tokens, temperature)

    ref_tok, ref_lp = reference(logits, keys)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(ref_lp), rtol=0, atol=1e-6)
    # the draws are random (many distinct tokens) and truncation was applied where asked
    assert len(np.unique(np.asarray(tok))) > 20
    kept = np.isfinite(np.asarray(truncate_logits(logits / temperature, top_k, top_p)))
    assert kept[np.arange(b), np.asarray(tok)].all()
    if top_k:
        assert kept.sum(-1).max() <= top_k
