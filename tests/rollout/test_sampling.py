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

from sampling_reference import sort_truncate_logits
from stapo_jax.algo.logprobs import logits_to_log_probs
from stapo_jax.rollout.sampling import (SamplingParams, SamplingParamsError, first_argmax, sample_tokens,
                                       truncate_logits)

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


# --- Bisection thresholds vs sort-based, float64 and transformers references -------------------------------------


def exact_keep(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Float64 keep-mask of the value rule of truncate_logits (independent of it, by sorting): keep
    x >= max(t_k, t_p), t_k the k-th largest value (repeats counted), t_p the smallest present value >= t_k whose
    entries <= it hold softmax mass (over the entries >= t_k) > 1 - top_p, else the row maximum."""
    x = logits.astype(np.float64)
    s = np.sort(x, axis=-1)  # ascending
    t_k = s[:, -top_k] if 0 < top_k < x.shape[-1] else np.full(x.shape[0], -np.inf)
    t = t_k
    if top_p < 1.0:
        cand = s >= t_k[:, None]
        e = np.where(cand, np.exp(s - s[:, -1:]), 0.0)
        tail = np.cumsum(e / e.sum(-1, keepdims=True), axis=-1)  # mass of the entries <= s[:, i]
        last_of_value = np.concatenate([s[:, :-1] != s[:, 1:], np.ones((x.shape[0], 1), bool)], axis=-1)
        ok = cand & last_of_value & (tail > np.float64(np.float32(1.0 - top_p)))  # the float32 bound, as ours
        t_p = np.where(ok, s, np.inf).min(-1)
        t = np.maximum(t_k, np.where(np.isinf(t_p), s[:, -1], t_p))
    return x >= t[:, None]


def hf_keep(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    scores = torch.tensor(logits)
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    if top_k:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return np.isfinite(scores.numpy())


def new_keep(logits, top_k, top_p) -> np.ndarray:
    out = np.asarray(jax.jit(truncate_logits, static_argnums=(1, 2))(jnp.asarray(logits), top_k, top_p))
    kept = np.isfinite(out)
    np.testing.assert_array_equal(out[kept], np.asarray(logits)[kept])  # kept entries unchanged
    return kept


def sort_keep(logits, top_k, top_p) -> np.ndarray:
    return np.isfinite(np.asarray(jax.jit(sort_truncate_logits, static_argnums=(1, 2))(jnp.asarray(logits), top_k,
                                                                                         top_p)))


@pytest.mark.parametrize("shape,scale", [((1024, 1000), 3.0), ((64, 20000), 3.0), ((1024, 300), 10.0)])
def test_bisection_keep_masks_equal_float64_transformers_and_sort_references(shape, scale):
    """Over many random rows (float32, no ties at a boundary) the bisection's keep-masks are exactly the float64
    reference's and transformers' warpers', for top-k, top-p and both; the sort-based thresholds it replaced
    agree wherever their float32 head-mass cumsum resolves the boundary, i.e. all settings except top_p close
    to 1, where that cumsum misplaces the boundary token in some rows and the tail sum does not."""
    logits = (np.random.default_rng(shape[1]).normal(size=shape) * scale).astype(np.float32)
    for top_k, top_p in [(50, 1.0), (1, 1.0), (0, 0.9), (0, 0.3), (0, 1e-6), (50, 0.9), (7, 0.5), (0, 0.99),
                         (0, 0.999), (100, 0.999)]:
        ours, exact, hf = new_keep(logits, top_k, top_p), exact_keep(logits, top_k, top_p), hf_keep(logits, top_k, top_p)
        np.testing.assert_array_equal(ours, exact, err_msg=f"top_k={top_k} top_p={top_p}")
        np.testing.assert_array_equal(ours, hf, err_msg=f"top_k={top_k} top_p={top_p}")
        assert ours.any(-1).all()
        old = sort_keep(logits, top_k, top_p)
        if top_p <= 0.9:
            np.testing.assert_array_equal(old, ours, err_msg=f"top_k={top_k} top_p={top_p}")
        elif top_p == 0.999 and top_k == 0 and shape[1] >= 1000 and scale == 3.0:
            wrong = (old != exact).any(-1)
            assert wrong.sum() >= 3 and (old != exact).sum(-1).max() == 1  # one boundary token per such row


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (40, 1.0), (0, 0.9), (0, 0.5), (40, 0.8), (3, 0.95)])
def test_bisection_with_many_ties_keeps_every_tie_of_the_thresholds(top_k, top_p):
    """bf16-quantised logits (1/8 steps, many exact ties): keep-masks equal the float64 value rule; top-k alone equals
    transformers' (value threshold there too); with top-p, transformers keeps a sort-order subset of the tied
    last value and ours keeps all of them, nothing else. Top-p alone equals the sort-based thresholds."""
    rng = np.random.default_rng(5)
    logits = (np.round(rng.normal(size=(256, 500)) * 16) / 8).astype(np.float32)  # steps of 1/8: bf16 values
    assert np.array_equal(np.asarray(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32)), logits)
    assert len(np.unique(logits[0])) < 150  # really tied
    ours, exact, hf = new_keep(logits, top_k, top_p), exact_keep(logits, top_k, top_p), hf_keep(logits, top_k, top_p)
    np.testing.assert_array_equal(ours, exact)
    if top_p == 1.0:
        np.testing.assert_array_equal(ours, hf)
        assert (ours.sum(-1) >= top_k).all() and (ours.sum(-1) > top_k).any()  # ties at the k-th value kept
    else:
        assert (ours >= hf).all()
        extra = ours & ~hf
        last = np.where(hf, logits, np.inf).min(-1)  # the smallest value transformers kept, per row
        assert np.all(logits[extra] == np.broadcast_to(last[:, None], logits.shape)[extra])
    if top_k == 0:
        np.testing.assert_array_equal(ours, sort_keep(logits, top_k, top_p))


def test_top_k_tied_at_the_kth_value_are_all_in_the_top_p_softmax():
    """[1, 0, 0], top_k=2, top_p=0.6: top-k keeps all three (ties); over their softmax (0.576, 0.212, 0.212)
    the two zeros hold 0.424 > 1 - 0.6, so they stay (transformers keeps one of them, by sort order). The
    sort-based code normalised over two candidates only (0.731, 0.269) and kept [1] alone."""
    x = np.array([[1.0, 0.0, 0.0]], np.float32)
    np.testing.assert_array_equal(new_keep(x, 2, 0.6), [[True, True, True]])
    assert hf_keep(x, 2, 0.6).sum() == 2
    np.testing.assert_array_equal(sort_keep(x, 2, 0.6), [[True, False, False]])


def test_truncation_edge_cases_top_k_over_vocab_top_p_one_tiny_top_p_and_neg_inf():
    rng = np.random.default_rng(9)
    x = (rng.normal(size=(8, 64)) * 3).astype(np.float32)
    for top_k, top_p in [(0, 1.0), (64, 1.0), (1000, 1.0)]:  # nothing removed: the input itself
        np.testing.assert_array_equal(np.asarray(truncate_logits(jnp.asarray(x), top_k, top_p)), x)
    np.testing.assert_array_equal(new_keep(x, 1000, 0.5), new_keep(x, 0, 0.5))
    # tiny top_p (1 - top_p rounds to 1 in float32): only the maximum, with its ties
    tied = x.copy()
    tied[:, 5] = tied.max(-1)
    for p in (1e-6, 1e-30):
        keep = new_keep(tied, 0, p)
        np.testing.assert_array_equal(keep, tied == tied.max(-1, keepdims=True))
        assert (keep.sum(-1) == 2).all()
    # -inf entries: never kept unless the whole row is -inf; top_k beyond the finite count keeps every finite one
    y = x.copy()
    y[:, 10:] = -np.inf
    y[0, 1:] = -np.inf  # one finite entry
    out = np.asarray(truncate_logits(jnp.asarray(y), 20, 0.999))
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(y) & exact_keep(y, 20, 0.999))
    assert np.isfinite(out[0]).sum() == 1
    for top_k, top_p in [(3, 1.0), (0, 0.5), (3, 0.7), (15, 0.9)]:
        np.testing.assert_array_equal(new_keep(y, top_k, top_p) & np.isfinite(y), exact_keep(y, top_k, top_p)
                                      & np.isfinite(y))
        np.testing.assert_array_equal(np.isfinite(np.asarray(truncate_logits(jnp.asarray(y), top_k, top_p))),
                                      hf_keep(y, top_k, top_p))
    # -0.0 and +0.0 are one value (tied)
    z = np.array([[0.0, -0.0, -1.0, -2.0]], np.float32)
    np.testing.assert_array_equal(new_keep(z, 1, 1.0), [[True, True, False, False]])
    np.testing.assert_array_equal(new_keep(z, 0, 0.5), [[True, True, False, False]])


def test_first_argmax_equals_jnp_argmax_on_ties_nan_and_infinite_rows():
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, size=(64, 257)).astype(np.float32)  # many tied maxima per row
    x[1] = -np.inf                                              # all -inf: index 0
    x[2, [5, 9]] = np.nan                                       # a NaN wins, the first one
    x[3, 7] = np.inf
    x[4, [0, 256]] = 10.0                                       # tie at both ends
    x[5] = np.nan
    for rows in (x, x[:, :1], rng.standard_normal((3, 4, 1031)).astype(np.float32)):
        got = np.asarray(jax.jit(first_argmax)(jnp.asarray(rows)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)))
    assert int(first_argmax(jnp.asarray(x))[4]) == 0 and int(first_argmax(jnp.asarray(x))[2]) == 5
