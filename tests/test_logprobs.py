"""Log-prob / entropy definitions vs PyTorch (verl), and the chunked path vs the naive one (values, gradients)."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import torch_reference as ref  # noqa: E402

from stapo_jax.logprobs import (  # noqa: E402
    chunked_log_probs_and_entropy,
    logits_to_log_probs,
    logits_to_log_probs_and_entropy,
)


def test_full_vocab_definition_matches_torch_float64():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 17)) * 3
    ids = rng.integers(0, 17, size=(3, 5))
    for temp in (1.0, 0.7):
        with jax.enable_x64(True):
            lp, ent = logits_to_log_probs_and_entropy(jnp.asarray(logits), jnp.asarray(ids), temp)
            lp2 = logits_to_log_probs(jnp.asarray(logits), jnp.asarray(ids), temp)
            lp, ent, lp2 = map(np.asarray, (lp, ent, lp2))
        tl = torch.tensor(logits)
        np.testing.assert_allclose(lp, ref.logprobs_from_logits(tl, torch.tensor(ids), temp).numpy(), atol=1e-12)
        np.testing.assert_allclose(ent, ref.entropy_from_logits(tl, temp).numpy(), atol=1e-12)
        np.testing.assert_array_equal(lp, lp2)
    # bf16 logits are computed in f32
    lp, ent = logits_to_log_probs_and_entropy(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(ids))
    assert lp.dtype == jnp.float32 and ent.dtype == jnp.float32


def naive(h, w, ids, temp):
    return logits_to_log_probs_and_entropy(jnp.einsum("btd,dv->btv", h, w), ids, temp)


@pytest.mark.parametrize("seq_chunk,vocab_chunk", [(4, None), (5, 7), (16, 41), (3, 64)])
def test_chunked_equals_naive_values_and_gradients(seq_chunk, vocab_chunk):
    rng = np.random.default_rng(1)
    b, t, d, v = 2, 13, 8, 41  # T and V not multiples of the chunks
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)))
    ch = lambda h, w: chunked_log_probs_and_entropy(h, w, ids, temperature=0.8, seq_chunk=seq_chunk,  # noqa: E731
                                                    vocab_chunk=vocab_chunk)
    a, n = ch(h, w), naive(h, w, ids, 0.8)
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(n[0]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(a[1]), np.asarray(n[1]), atol=2e-5)
    cw = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)
    ce = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

    def loss(fn):
        return lambda h, w: jnp.sum(fn(h, w)[0] * cw) + jnp.sum(fn(h, w)[1] * ce)

    ga = jax.jit(jax.grad(loss(ch), argnums=(0, 1)))(h, w)
    gn = jax.grad(loss(lambda h, w: naive(h, w, ids, 0.8)), argnums=(0, 1))(h, w)
    for x, y in zip(ga, gn):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-4, rtol=1e-4)


def test_chunked_float64_matches_torch_tightly():
    rng = np.random.default_rng(2)
    h, w = rng.normal(size=(2, 6, 4)), rng.normal(size=(4, 23))
    ids = rng.integers(0, 23, size=(2, 6))
    with jax.enable_x64(True):
        lp, ent = chunked_log_probs_and_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(ids), seq_chunk=4,
                                                vocab_chunk=5)
        lp, ent = np.asarray(lp), np.asarray(ent)
    logits = torch.tensor(h) @ torch.tensor(w)
    np.testing.assert_allclose(lp, ref.logprobs_from_logits(logits, torch.tensor(ids)).numpy(), atol=1e-12)
    np.testing.assert_allclose(ent, ref.entropy_from_logits(logits).numpy(), atol=1e-12)


def test_no_full_logits_buffer_in_compiled_chunked_function():
    b, t, d, v = 1, 256, 16, 4096
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def peak(fn):
        m = jax.jit(jax.grad(lambda h, w, i: jnp.sum(sum(fn(h, w, i))), argnums=(0, 1))).lower(h, w, ids).compile()
        ma = m.memory_analysis()
        return ma.temp_size_in_bytes

    full = peak(lambda h, w, i: naive(h, w, i, 1.0))
    chunked = peak(lambda h, w, i: chunked_log_probs_and_entropy(h, w, i, seq_chunk=32, vocab_chunk=1024))
    assert full >= b * t * v * 4  # the naive path holds [B, T, V] f32
    assert chunked < full / 8, (chunked, full)


def test_bad_inputs():
    with pytest.raises(ValueError, match="token_ids"):
        logits_to_log_probs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="temperature"):
        logits_to_log_probs(jnp.zeros((2, 5)), jnp.zeros((2,), jnp.int32), 0.0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((4, 5)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="token_ids"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((3, 5)), jnp.zeros((1, 2)))
