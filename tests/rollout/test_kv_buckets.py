"""The rollout driver's KV-cache buckets (``EngineConfig.kv_cache_buckets``): the decode state's cache is kept at the
smallest of ``kv_length_buckets`` that holds the active slots, so a decode step reads only about as many cache
positions as are filled. The length must not change the result beyond float rounding."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fixtures_rollout import RAGGED_PROMPTS, make_engine, tiny_model
from models.kv_cache import cached_attention
from stapo_jax.rollout.decode_fns import kv_length_buckets
from stapo_jax.rollout.driver import RolloutDriver
from stapo_jax.rollout.engine import EngineConfig, EngineConfigError, Qwen3Engine
from stapo_jax.rollout.sampling import SamplingParams


def test_kv_length_buckets():
    assert kv_length_buckets(144) == (32, 64, 128, 144)
    assert kv_length_buckets(20) == (20,)
    assert kv_length_buckets(300, smallest=16) == (16, 32, 64, 128, 256, 300)
    b = kv_length_buckets(1024 + 16384)
    assert b[-1] == 17408 and b[-2] == 16384 and len(b) == 11
    assert all(x < y for x, y in zip(b, b[1:]))
    with pytest.raises(ValueError, match="capacity"):
        kv_length_buckets(0)


def test_cached_attention_matches_softmax_attention_in_every_cache_length():
    """Late normalisation ``(p @ v) / sum(p)`` is softmax attention; trailing masked positions (random garbage,
    as a reused slot holds) change nothing beyond float rounding."""
    b, nkv, g, h = 4, 2, 2, 16
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, 1, nkv * g, h)), jnp.float32)
    kv = rng.standard_normal((2, b, nkv, 512, h)).astype(np.float32)
    fill = np.array([1, 37, 100, 127])
    fn = jax.jit(lambda q, k, v, m: cached_attention(q, k, v, m, h ** -0.5))
    qh = np.asarray(q)[:, 0].reshape(b, nkv, g, h).astype(np.float64)
    logits = np.einsum("bkgh,bksh->bkgs", qh, kv[0, :, :, :128]) * h ** -0.5
    logits = np.where(np.arange(128)[None, None, None, :] < fill[:, None, None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    want = np.einsum("bkgs,bksh->bkgh", p / p.sum(-1, keepdims=True), kv[1, :, :, :128]).reshape(b, nkv * g, h)
    for s in (128, 160, 512):
        mask = (np.arange(s)[None, :] < fill[:, None])[:, None, None, :]
        got = np.asarray(fn(q, jnp.asarray(kv[0, :, :, :s]), jnp.asarray(kv[1, :, :, :s]), jnp.asarray(mask)))
        np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6, err_msg=f"cache length {s}")
    np.testing.assert_allclose(want[0], kv[1, 0, np.arange(nkv * g) // g, 0], rtol=1e-6)  # one key: its value


EOS = 112  # this tiny model under seed 11 stops rows after 8 to 145 tokens, three run to 290


def _engine(buckets: bool, sampling, slots=4, max_prefill_length=32, max_decode_length=300, eos_token_ids=None):
    eng = make_engine(tiny_model(0), slots=slots, sampling=sampling, max_prefill_length=max_prefill_length,
                      max_decode_length=max_decode_length, eos_token_ids=eos_token_ids)
    return Qwen3Engine(tiny_model(0), dataclasses.replace(eng.config, kv_cache_buckets=buckets))


@pytest.mark.parametrize("steps_per_sync", [1, 8])
def test_driver_results_match_the_full_cache_engine(steps_per_sync, monkeypatch):
    """Rows of very different lengths and slot refills, so the cache grows and shrinks; tokens equal those of
    the engine that always holds the full cache, log-probs to float rounding."""
    sampling = SamplingParams(temperature=1.0, top_k=50)
    prompts = RAGGED_PROMPTS + [[5, 6, 7] * 9]
    lengths_seen = []
    real_resize = Qwen3Engine.resize_decode_state

    def spy(self, state, length):
        lengths_seen.append((state.cache.max_length, length))
        out = real_resize(self, state, length)
        assert out.cache.max_length == length and all(x.shape[2] == length for x in out.cache.k + out.cache.v)
        return out

    monkeypatch.setattr(Qwen3Engine, "resize_decode_state", spy)
    runs = {}
    for buckets in (True, False):
        eng = _engine(buckets, sampling, slots=3, eos_token_ids=(EOS,))
        assert eng.kv_length_buckets == ((32, 64, 128, 256, 332) if buckets else (332,))
        driver = RolloutDriver(eng, steps_per_sync=steps_per_sync)
        runs[buckets] = driver.generate(prompts, num_samples=2, max_new_tokens=290, seed=11)
    a, b = runs[True], runs[False]
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, rtol=1e-5, atol=1e-5)
    assert a.response_lengths.max() > 256 and a.response_lengths.min() < 64, a.response_lengths
    grown = {new for old, new in lengths_seen if new > old}
    assert {64, 128, 256, 332} <= grown, lengths_seen
    assert any(new < old for old, new in lengths_seen), "the cache never shrank"


def test_resize_keeps_filled_positions_and_rejects_other_lengths():
    eng = _engine(True, SamplingParams(greedy=True))
    state = eng.init_decode_state(0, length=32)
    assert state.cache.k[0].shape[2] == 32 and state.cache.key_mask.shape == (4, 32)
    prefix = eng.prefill_tokens(eng.load_params(), np.arange(1, 20, dtype=np.int32))
    state = eng.insert_sample(prefix, state, 1, 0, 8)
    k_before = np.asarray(state.cache.k[1])
    mask_before = np.asarray(state.cache.key_mask)
    grown = eng.resize_decode_state(state, 128)
    assert state.cache.k[1].is_deleted()  # consumed, layer by layer
    np.testing.assert_array_equal(np.asarray(grown.cache.k[1])[:, :, :32], k_before)
    assert not np.asarray(grown.cache.k[1])[:, :, 32:].any() and not np.asarray(grown.cache.key_mask)[:, 32:].any()
    np.testing.assert_array_equal(np.asarray(grown.cache.key_mask)[:, :32], mask_before)
    assert grown.cache.k[1].sharding.is_equivalent_to(eng.decode_spec.state_shardings.cache.k[1], 4)
    shrunk = eng.resize_decode_state(grown, 32)
    np.testing.assert_array_equal(np.asarray(shrunk.cache.k[1]), k_before)
    for bad in (33, 1000):
        with pytest.raises(ValueError, match="KV-cache lengths"):
            eng.resize_decode_state(shrunk, bad)
        with pytest.raises(ValueError, match="KV-cache lengths"):
            eng.init_decode_state(0, length=bad)


def test_engine_config_rejects_a_non_bool_kv_cache_buckets():
    with pytest.raises(EngineConfigError, match="kv_cache_buckets"):
        EngineConfig(kv_cache_buckets="yes")


def test_rows_that_fill_the_whole_cache_with_several_steps_per_sync():
    """A longest prompt plus ``max_decode_length`` new tokens fills the cache exactly; ``steps_per_sync`` = 8 asks
    for up to 7 positions beyond a row's last token, which the bucket choice must not request (regression: the
    eval command raised "27 cache positions exceed the engine's cache (26)")."""
    sampling = SamplingParams(greedy=True)
    prompts = [list(range(1, 33)), [5, 9], list(range(40, 60))]
    runs = {}
    for buckets in (True, False):
        eng = _engine(buckets, sampling, slots=2, max_prefill_length=32, max_decode_length=21)
        assert eng.kv_length_buckets[-1] == 53
        runs[buckets] = RolloutDriver(eng, steps_per_sync=8).generate(prompts, max_new_tokens=21)
    np.testing.assert_array_equal(runs[True].responses, runs[False].responses)
    assert runs[True].response_lengths.tolist() == [21, 21, 21]


def test_rollout_kv_cache_buckets_config_key():
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.config.schema import load_config
    from stapo_jax.rollout import engine_config

    base = "configs/tiny_cpu.yaml"
    assert load_config(base).rollout.kv_cache_buckets is True
    assert engine_config(load_config(base)).kv_cache_buckets is True
    assert engine_config(load_config(base, ["rollout.kv_cache_buckets=false"])).kv_cache_buckets is False
    with pytest.raises(ConfigError, match="rollout.kv_cache_buckets"):
        load_config(base, ["rollout.kv_cache_buckets=sometimes"])


def test_engine_api_rejects_unfit_states_with_clear_errors():
    """The JetStream insert needs a full-length state (a row could outgrow a shorter one and overwrite its last
    key silently); a prefix longer than the state, a float or bool length and a consumed state are named."""
    eng = _engine(True, SamplingParams(greedy=True), slots=2, max_prefill_length=64, max_decode_length=8)
    assert eng.kv_length_buckets == (32, 64, 72)
    params = eng.load_params()
    short = eng.init_decode_state(0, length=32)
    one = eng.prefill(params=params, padded_tokens=np.arange(1, 17, dtype=np.int32), true_length=16)
    with pytest.raises(ValueError, match="holds 32 positions, the insert needs 72"):
        eng.insert(one, short, 0)
    long_prefix = eng.prefill_tokens(params, list(range(1, 40)))  # prefill bucket 64
    msg = r"holds 32 positions, the insert needs 64 .*resize_decode_state\(state, 64\)"
    with pytest.raises(ValueError, match=msg):
        eng.insert_sample(long_prefix, short, 0, 0, 8)
    for bad in (64.0, True):
        with pytest.raises(ValueError, match="KV-cache lengths"):
            eng.resize_decode_state(short, bad)
        with pytest.raises(ValueError, match="KV-cache lengths"):
            eng.init_decode_state(0, length=bad)
    grown = eng.resize_decode_state(short, 64)
    for length in (32, 64):
        with pytest.raises(ValueError, match="consumed"):
            eng.resize_decode_state(short, length)
    state = eng.insert_sample(long_prefix, grown, 1, 0, 8)  # fits now
    full = eng.insert(one, eng.init_decode_state(0), 0)
    assert full.cache.max_length == 72 and state.cache.max_length == 64


def test_row_offset_beyond_int32_sample_ids_is_rejected():
    from stapo_jax.rollout.driver import RolloutInputError

    driver = RolloutDriver(_engine(True, SamplingParams(greedy=True)))
    with pytest.raises(RolloutInputError, match="row_offset=2147483647"):
        driver.generate([[1, 2]], num_samples=2, max_new_tokens=2, row_offset=2**31 - 1)
