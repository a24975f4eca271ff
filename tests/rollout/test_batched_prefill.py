"""Batched prefill of the rollout engine (``EngineConfig.prefill_batch_size``, ``Qwen3Engine.prefill_batch``):
a prompt's prefix does not depend on its batch neighbours or row (bitwise), matches the one-prompt prefill, and
the driver's results do not depend on how prompts are grouped into prefill batches, split across calls
(``row_offset``, as stapo_jax.rollout.multihost splits a global batch) or spread over slots."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fixtures_rollout import RAGGED_PROMPTS, make_engine, rows_of, tiny_model
from models.decode import greedy_generate
from stapo_jax.rollout.driver import RolloutDriver
from stapo_jax.rollout.engine import EngineConfig, EngineConfigError, Qwen3Engine
from stapo_jax.rollout.sampling import SamplingParams

MODEL = tiny_model(0)
K = 3  # prefill_batch_size of these tests
SAMPLING = SamplingParams(temperature=0.8, top_k=20)
EOS = tuple(range(3, 128, 16))  # sampled rows end at varied lengths
# Mixed lengths over the 16- and 32-token buckets (max_prefill_length 32), more prompts than K per bucket.
LENGTHS = [3, 20, 5, 17, 9, 30, 1, 12, 25, 7, 32, 16]
PROMPTS = [[(11 * i + 5 * j + 1) % 128 for j in range(n)] for i, n in enumerate(LENGTHS)]


def engine(slots=4, k=K, sampling=SAMPLING, eos=EOS, model=MODEL, kv_cache_buckets=True):
    eng = make_engine(model, slots=slots, sampling=sampling, eos_token_ids=eos)
    return Qwen3Engine(model, dataclasses.replace(eng.config, prefill_batch_size=k, kv_cache_buckets=kv_cache_buckets))


def row(prefix, r):
    """Row ``r`` of every leaf of a batched Prefix, as numpy arrays."""
    return jax.tree.map(lambda a: np.asarray(a[r]), prefix)


def test_prefix_row_is_bitwise_independent_of_neighbours_and_position():
    eng = engine(k=4)
    params = eng.load_params()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, 21).tolist()  # bucket 32
    ref = None
    for r in range(4):
        for n_used in sorted({r + 1, 4}):  # dummy rows after it, or a full batch
            batch = [rng.integers(0, 128, rng.integers(17, 33)).tolist() for _ in range(n_used)]
            batch[r] = prompt
            pre = eng.prefill_batch(params, batch)
            assert pre.cache.k[0].shape == (4, 2, 32, 8) and pre.next_token.shape == (4,)
            assert np.asarray(pre.valid).tolist() == [True] * n_used + [False] * (4 - n_used)
            got = row(pre, r)
            assert int(got.next_token) == prompt[-1] and int(got.cache.length) == 20
            if ref is None:
                ref = got
                continue
            for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
                np.testing.assert_array_equal(a, b)  # bitwise
    assert np.abs(ref.cache.k[1][:, :20]).max() > 0.1  # real keys were compared, not zeros


def test_batched_rows_match_the_one_prompt_prefill():
    batched, single = engine(k=4), engine(k=1)
    prompts = [PROMPTS[i] for i in (0, 2, 4, 9)]  # bucket 16
    pre = batched.prefill_batch(batched.load_params(), prompts)
    for r, p in enumerate(prompts):
        one = single.prefill_tokens(single.load_params(), p)
        assert one.next_token.shape == (1,)
        got, want = row(pre, r), row(one, 0)
        for a, b in zip(got.cache.k + got.cache.v, want.cache.k + want.cache.v):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        for f in ("key_mask", "length", "next_position"):
            np.testing.assert_array_equal(getattr(got.cache, f), getattr(want.cache, f))
        assert int(got.next_token) == int(want.next_token) == p[-1] and bool(got.valid) and bool(want.valid)
    # The JetStream path: one prompt, a one-row Prefix, inserted from row 0.
    jet = single.prefill(params=single.load_params(), padded_tokens=np.asarray(prompts[1] + [0] * 11),
                         true_length=len(prompts[1]))
    assert jet.next_token.shape == (1,) and int(jet.next_token[0]) == prompts[1][-1]
    np.testing.assert_allclose(np.asarray(jet.cache.k[0][0]), row(pre, 1).cache.k[0], rtol=0, atol=1e-5)


def test_prefill_batch_rejects_bad_groups():
    eng = engine(k=2)
    params = eng.load_params()
    with pytest.raises(ValueError, match="1..2 prompts"):
        eng.prefill_batch(params, [[1], [2], [3]])
    with pytest.raises(ValueError, match="1..2 prompts"):
        eng.prefill_batch(params, [])
    with pytest.raises(ValueError, match="one prefill bucket"):
        eng.prefill_batch(params, [[1] * 3, [1] * 20])


def _recorded(drv):
    """Wrap ``drv.engine``'s prefill_batch / insert_sample: returns the list of prefill groups (prompt lengths)
    and a check that every prefix whose rows were all inserted G times is freed (at most the driver's two
    locals, the last prefilled and the last inserted prefix, may still hold one)."""
    eng, groups, refs, inserted = drv.engine, [], [], {}
    prefill, insert = eng.prefill_batch, eng.insert_sample

    def prefill_batch(params, prompts):
        gc.collect()
        complete_alive = [r for r, n in refs if r() is not None and inserted.get(id(r), 0) == n]
        assert len(complete_alive) <= 2, "a fully inserted prefix was not freed"
        out = prefill(params, prompts)
        groups.append([len(p) for p in prompts])
        ref = weakref.ref(out)
        refs.append((ref, len(prompts) * G))
        inserted[id(ref)] = 0
        by_prefix[id(out)] = ref
        return out

    by_prefix = {}

    def insert_sample(prefix, state, slot, sample_id, max_new_tokens, row=0):
        inserted[id(by_prefix[id(prefix)])] += 1
        return insert(prefix, state, slot, sample_id, max_new_tokens, row)

    eng.prefill_batch, eng.insert_sample = prefill_batch, insert_sample
    return groups, refs


G = 2


def test_driver_results_do_not_depend_on_grouping_split_or_slots():
    whole_drv = RolloutDriver(engine(slots=4))
    groups, refs = _recorded(whole_drv)
    whole = whole_drv.generate(PROMPTS, num_samples=G, max_new_tokens=10, seed=7)
    # Prompts were batched: each call within one bucket, in prompt order, at most K prompts.
    bucket = lambda n: 16 if n <= 16 else 32  # noqa: E731
    assert sum(map(len, groups)) == len(PROMPTS) and max(map(len, groups)) == K and len(groups) < len(PROMPTS)
    assert all(len({bucket(n) for n in g}) == 1 for g in groups)
    assert groups[0] == [3, 5, 9] and groups[1] == [20, 17, 30]
    gc.collect()
    assert all(r() is None for r, _ in refs)
    # Sampling is real: groups differ, lengths vary.
    assert any(rows_of(whole, 2 * i) != rows_of(whole, 2 * i + 1) for i in range(len(PROMPTS)))
    assert len(set(whole.response_lengths.tolist())) > 1
    # Two process shares (row_offset, as multihost: same engine config per process) -> other prefill groups
    # ([0, 2, 4], [1, 3] in the first share), the same bits with a full-length KV cache
    # (kv_cache_buckets=False); with the default buckets the cache length follows the share's own slots, so
    # the log-probs agree to float rounding (tests/rollout/test_kv_buckets.py).
    cut = 5
    for buckets in (False, True):
        ref = whole if buckets else RolloutDriver(engine(slots=4, kv_cache_buckets=False)).generate(
            PROMPTS, num_samples=G, max_new_tokens=10, seed=7)
        np.testing.assert_array_equal(ref.responses, whole.responses)
        first = RolloutDriver(engine(slots=4, kv_cache_buckets=buckets)).generate(
            PROMPTS[:cut], num_samples=G, max_new_tokens=10, seed=7)
        second = RolloutDriver(engine(slots=4, kv_cache_buckets=buckets)).generate(
            PROMPTS[cut:], num_samples=G, max_new_tokens=10, seed=7, row_offset=cut * G)
        for part, rows in ((first, slice(0, cut * G)), (second, slice(cut * G, None))):
            np.testing.assert_array_equal(part.responses, ref.responses[rows])
            np.testing.assert_array_equal(part.response_lengths, ref.response_lengths[rows])
            if buckets:
                np.testing.assert_allclose(part.rollout_log_probs, ref.rollout_log_probs[rows], rtol=0, atol=1e-5)
            else:
                np.testing.assert_array_equal(part.rollout_log_probs, ref.rollout_log_probs[rows])  # bitwise
    # Other slot counts: the same tokens; the log-probs only to float32 rounding, since the decode step's
    # [B, ...] shape changes (as before batched prefill: tests/rollout/test_driver.py compares them to 1e-5 too).
    for slots in (1, 7):
        other = RolloutDriver(engine(slots=slots)).generate(PROMPTS, num_samples=G, max_new_tokens=10, seed=7)
        np.testing.assert_array_equal(other.responses, whole.responses)
        np.testing.assert_allclose(other.rollout_log_probs, whole.rollout_log_probs, rtol=0, atol=1e-5)


def test_greedy_driver_equals_greedy_generate():
    prompts = RAGGED_PROMPTS + [PROMPTS[1], PROMPTS[5]]
    batch = RolloutDriver(engine(slots=3, k=2, sampling=SamplingParams(greedy=True), eos=None)).generate(
        prompts, max_new_tokens=8)
    for i, p in enumerate(prompts):
        ids = jnp.asarray([p], jnp.int32)
        tokens, lengths = greedy_generate(MODEL, ids, jnp.ones_like(ids, bool), 8)
        assert int(lengths[0]) == 8
        assert rows_of(batch, i) == np.asarray(tokens[0]).tolist(), f"prompt {i}"


@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_engine_config_rejects_a_bad_prefill_batch_size(value):
    with pytest.raises(EngineConfigError, match="prefill_batch_size"):
        EngineConfig(prefill_batch_size=value)


def test_rollout_prefill_batch_size_config_key():
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.config.schema import load_config
    from stapo_jax.rollout import engine_config

    base = "configs/tiny_cpu.yaml"
    assert load_config(base).rollout.prefill_batch_size == 8
    assert engine_config(load_config(base)).prefill_batch_size == 8
    assert engine_config(load_config(base, ["rollout.prefill_batch_size=3"])).prefill_batch_size == 3
    with pytest.raises(ConfigError, match="rollout.prefill_batch_size"):
        load_config(base, ["rollout.prefill_batch_size=0"])


def test_prefill_rows_shrink_for_long_prompts():
    """``prefill_batch_tokens`` bounds a call's rows by its bucket: 16-token prompts 2 per call, 32-token ones 1."""
    eng = Qwen3Engine(MODEL, dataclasses.replace(engine(k=3).config, prefill_batch_tokens=40))
    assert [eng.prefill_rows(b) for b in (16, 32, 64)] == [2, 1, 1]
    params = eng.load_params()
    pre = eng.prefill_batch(params, [PROMPTS[0], PROMPTS[2]])
    assert pre.cache.k[0].shape[0] == 2 and np.asarray(pre.valid).tolist() == [True, True]
    assert eng.prefill_batch(params, [PROMPTS[1]]).cache.k[0].shape[:3:2] == (1, 32)
    with pytest.raises(ValueError, match="1..1 prompts of bucket 32"):
        eng.prefill_batch(params, [PROMPTS[1], PROMPTS[3]])
    with pytest.raises(EngineConfigError, match="prefill_batch_tokens"):
        EngineConfig(prefill_batch_tokens=0)
    # the driver forms groups of at most prefill_rows(bucket) prompts, with the same results as K=3 groups
    got = RolloutDriver(eng).generate(PROMPTS, num_samples=G, max_new_tokens=6, seed=7)
    ref = RolloutDriver(engine(k=1)).generate(PROMPTS, num_samples=G, max_new_tokens=6, seed=7)
    np.testing.assert_array_equal(got.responses, ref.responses)
    np.testing.assert_allclose(got.rollout_log_probs, ref.rollout_log_probs, rtol=0, atol=1e-5)
