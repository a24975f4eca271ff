"""Log-prob / entropy definitions vs PyTorch (verl), and the chunked path vs the naive one (values, gradients)."""

import functools
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import torch_reference as ref

import stapo_jax.algo.chunked_logprobs as chunked_module
from stapo_jax.algo.logprobs import logits_to_log_probs, logits_to_log_probs_and_entropy
from stapo_jax.algo.chunked_logprobs import chunked_log_probs_and_entropy


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


@pytest.mark.parametrize("budget", [0, None])  # 0: the backward recomputes the logits; None: it keeps them
@pytest.mark.parametrize("seq_chunk,vocab_chunk", [(4, None), (5, 7), (16, 41), (3, 64)])
def test_chunked_equals_naive_values_and_gradients(seq_chunk, vocab_chunk, budget):
    rng = np.random.default_rng(1)
    b, t, d, v = 2, 13, 8, 41  # T and V not multiples of the chunks
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)))
    ch = lambda h, w: chunked_log_probs_and_entropy(h, w, ids, temperature=0.8, seq_chunk=seq_chunk,
                                                    vocab_chunk=vocab_chunk, max_saved_logits_bytes=budget)
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


def test_full_logits_buffer_only_within_the_saved_logits_budget():
    """Compiled forward+backward temporaries (XLA memory analysis): below the budget the [B, T, V] float32 logits
    are kept for the backward; one byte less and they are recomputed, and the temporaries stay < 1/8 of the
    naive path's. A forward without differentiation keeps nothing whatever the budget."""
    b, t, d, v = 1, 256, 16, 4096
    h = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    logits_bytes = b * t * v * 4

    def peak(fn, grad=True):
        f = jax.grad(lambda h, w, i: jnp.sum(sum(fn(h, w, i))), argnums=(0, 1)) if grad else fn
        return jax.jit(f).lower(h, w, ids).compile().memory_analysis().temp_size_in_bytes

    def chunked(budget):
        return lambda h, w, i: chunked_log_probs_and_entropy(h, w, i, seq_chunk=32, vocab_chunk=1024,
                                                             max_saved_logits_bytes=budget)

    full = peak(lambda h, w, i: naive(h, w, i, 1.0))
    assert full >= logits_bytes  # the naive path holds [B, T, V] f32
    recompute = peak(chunked(logits_bytes - 1))
    assert recompute < full / 8, (recompute, full)
    assert peak(chunked(0)) == recompute
    kept = peak(chunked(logits_bytes))
    assert logits_bytes <= kept < logits_bytes + full / 8, (kept, logits_bytes)
    assert peak(chunked(logits_bytes), grad=False) < logits_bytes / 8


def test_default_budget_recomputes_at_long_sequences():
    """The default at the log-prob memory goal's shape (T=4,096, V=151,936, D=1,024, bf16 head): the logits
    (2.3 GiB) exceed ``SAVED_LOGITS_BYTES``, so the compiled forward+backward holds no [B, T, V] float32 buffer
    (its temporaries are a sixth of one; ``bench/bench_logprobs.py`` compares them with the naive path's)."""
    b, t, d, v = 1, 4096, 1024, 151936
    assert b * t * v * 4 > chunked_module.SAVED_LOGITS_BYTES
    specs = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, t), jnp.int32))
    fn = jax.grad(lambda h, w, i: jnp.sum(sum(chunked_log_probs_and_entropy(h, w, i, seq_chunk=128))),
                  argnums=(0, 1))
    temp = _compiled_temp_bytes(fn, *specs)
    assert temp < b * t * v * 4 / 4, (temp, b * t * v * 4)


@pytest.mark.parametrize("seq_chunk,vocab_chunk", [(4, None), (5, 7), (13, 41), (16, 10)])
def test_kept_logits_backward_equals_recompute_backward(monkeypatch, seq_chunk, vocab_chunk):
    """The two backward modes (logits kept vs recomputed) give the same values and gradients w.r.t. hidden, head
    and temperature in float32, with collision probabilities and ragged tiles on both axes."""
    monkeypatch.setattr(chunked_module, "BACKWARD_VOCAB_CHUNK", 16)
    rng = np.random.default_rng(5)
    b, t, d, v = 2, 13, 8, 41
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.8, jnp.float32)
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)))
    cts = [jnp.asarray(rng.normal(size=(b, t)), jnp.float32) for _ in range(3)]

    def run(budget):
        def loss(h, w, temperature):
            outs = chunked_log_probs_and_entropy(h, w, ids, temperature=temperature, seq_chunk=seq_chunk,
                                                 vocab_chunk=vocab_chunk, with_collision=True,
                                                 max_saved_logits_bytes=budget)
            return sum(jnp.sum(o * g) for o, g in zip(outs, cts)), outs

        (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(h, w, jnp.float32(0.7))
        return [np.asarray(x) for x in outs], [np.asarray(x) for x in grads]

    (outs_k, grads_k), (outs_r, grads_r) = run(b * t * v * 4), run(0)
    for x, y in zip(outs_k, outs_r):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-6)
    for x, y in zip(grads_k, grads_r):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


def test_kept_logits_backward_holds_one_logits_buffer_with_temperature_and_collision_gradients():
    """The kept-logits backward overwrites the kept [B, T, V] logits with d logits in place: the compiled
    forward+backward holds one such buffer also when d temperature or the collision gradient is wanted (the
    label logits they need come from the forward, not from the kept buffer, which would then stay live across
    the in-place loop and be copied)."""
    b, t, d, v = 2, 64, 32, 4096
    logits_bytes = b * t * v * 4
    specs = (jax.ShapeDtypeStruct((b, t, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
             jax.ShapeDtypeStruct((b, t), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32))
    for with_collision in (False, True):
        for argnums in ((0, 1), (0, 1, 3)):
            fn = jax.grad(lambda h, w, i, temp: jnp.sum(sum(chunked_log_probs_and_entropy(
                h, w, i, temperature=temp, seq_chunk=16, with_collision=with_collision))), argnums=argnums)
            temp_bytes = _compiled_temp_bytes(fn, *specs)
            assert logits_bytes <= temp_bytes < 1.5 * logits_bytes, (with_collision, argnums, temp_bytes)


def test_kept_logits_collision_gradient_keeps_relative_precision_as_p_y_goes_to_one():
    """d C' / d h at a near-certain token (p_y -> 1, C' ~ 1e-18) is ~1e-17: the kept-logits backward must not
    form it as the difference of two O(1) terms (2 p_y (p_y - C') - 2 p_y^2), which cancels to 0 or noise; it
    agrees with the recompute backward and the float64 gradient to float32 relative precision."""
    rng = np.random.default_rng(3)
    b, t, d, v = 2, 6, 8, 33
    h = rng.normal(size=(b, t, d)) * 8.0
    w = rng.normal(size=(d, v))
    ids = np.argmax(np.einsum("btd,dv->btv", h, w), axis=-1)

    def collision_others(h, w):
        p = jax.nn.softmax(jnp.einsum("btd,dv->btv", h, w, precision="highest"), axis=-1)
        return jnp.sum(jnp.where(jax.nn.one_hot(ids, v, dtype=bool), 0.0, p * p), axis=-1)

    with jax.enable_x64(True):
        want = np.asarray(jax.grad(lambda h: jnp.sum(collision_others(h, jnp.asarray(w))))(jnp.asarray(h)))
        c = np.asarray(collision_others(jnp.asarray(h), jnp.asarray(w)))
    peaked = c < 1e-12
    assert peaked.any()
    for budget in (0, None):
        got = np.asarray(jax.grad(lambda h: jnp.sum(chunked_log_probs_and_entropy(
            h, jnp.asarray(w, jnp.float32), jnp.asarray(ids), seq_chunk=4, with_collision=True,
            max_saved_logits_bytes=budget)[2]))(jnp.asarray(h, jnp.float32)))
        err = np.abs(got[peaked] - want[peaked]).max(axis=-1)
        assert np.all(err <= 1e-3 * np.abs(want[peaked]).max(axis=-1)), (budget, err, np.abs(want[peaked]).max(-1))


def _torch_reference_with_grads(h, w, ids, temp, cotangents):
    """verl log-probs / entropy (and sum_{v != y} p_v^2) in float64 torch, and the autograd gradient of
    sum(cotangent * output) w.r.t. hidden, head weight and temperature."""
    th, tw = torch.tensor(h, requires_grad=True), torch.tensor(w, requires_grad=True)
    tt = torch.tensor(temp, dtype=torch.float64, requires_grad=True)
    logits = th @ tw
    lp = ref.logprobs_from_logits(logits, torch.tensor(ids), tt)
    ent = ref.entropy_from_logits(logits, tt)
    others = 1.0 - torch.nn.functional.one_hot(torch.tensor(ids), logits.shape[-1]).to(logits.dtype)
    coll = torch.sum(torch.softmax(logits / tt, dim=-1) ** 2 * others, dim=-1)
    loss = sum(torch.sum(o * torch.tensor(g)) for o, g in zip((lp, ent, coll), cotangents))
    gh, gw, gt = torch.autograd.grad(loss, (th, tw, tt))
    return [x.detach().numpy() for x in (lp, ent, coll)], [x.numpy() for x in (gh, gw, gt)]


# (seq_chunk, vocab_chunk, backward vocabulary tile when vocab_chunk is None); T=13, V=41 are multiples of none
@pytest.mark.parametrize("budget", [0, None])  # 0: the backward recomputes the logits; None: it keeps them
@pytest.mark.parametrize("seq_chunk,vocab_chunk,bwd_tile", [(4, None, 8192), (5, None, 16), (13, 7, None),
                                                            (3, 41, None), (16, 10, None)])
def test_custom_vjp_gradients_match_torch_autograd_float64(monkeypatch, seq_chunk, vocab_chunk, bwd_tile, budget):
    """Hand-written backward vs PyTorch autograd: d/d hidden, d/d lm_head_weight and d/d temperature of a
    weighted sum of log-probs, entropies and collision probabilities, with ragged last tiles on both axes."""
    if bwd_tile is not None:
        monkeypatch.setattr(chunked_module, "BACKWARD_VOCAB_CHUNK", bwd_tile)
    rng = np.random.default_rng(3)
    b, t, d, v, temp = 2, 13, 8, 41, 0.7
    h, w = rng.normal(size=(b, t, d)), rng.normal(size=(d, v)) * 0.8
    ids = rng.integers(0, v, size=(b, t))
    cts = [rng.normal(size=(b, t)) for _ in range(3)]
    (r_lp, r_ent, r_col), (r_gh, r_gw, r_gt) = _torch_reference_with_grads(h, w, ids, temp, cts)
    with jax.enable_x64(True):
        def loss(h, w, temperature):
            outs = chunked_log_probs_and_entropy(h, w, jnp.asarray(ids), temperature=temperature,
                                                 seq_chunk=seq_chunk, vocab_chunk=vocab_chunk, with_collision=True,
                                                 max_saved_logits_bytes=budget)
            return sum(jnp.sum(o * g) for o, g in zip(outs, cts)), outs

        (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            jnp.asarray(h), jnp.asarray(w), jnp.asarray(temp))
        outs, grads = [np.asarray(x) for x in outs], [np.asarray(x) for x in grads]
    for got, want in zip(outs, (r_lp, r_ent, r_col)):
        np.testing.assert_allclose(got, want, atol=1e-11)
    for got, want in zip(grads, (r_gh, r_gw, r_gt)):
        np.testing.assert_allclose(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("budget", [0, None])
@pytest.mark.parametrize("vocab_chunk", [None, 16])
def test_bf16_weight_gradients_match_float64_reference(monkeypatch, vocab_chunk, budget):
    """bf16 hidden states and head weight (the training dtype): float32 accumulation gives gradients within
    bf16 rounding of the float64 torch gradient, returned in the inputs' dtypes, no worse than JAX autodiff of
    the naive path."""
    monkeypatch.setattr(chunked_module, "BACKWARD_VOCAB_CHUNK", 16)
    rng = np.random.default_rng(4)
    b, t, d, v, temp = 1, 19, 16, 53, 1.3
    h = jnp.asarray(rng.normal(size=(b, t, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(d, v)) * 0.3, jnp.bfloat16)
    ids = rng.integers(0, v, size=(b, t))
    cts = [rng.normal(size=(b, t)) for _ in range(2)] + [np.zeros((b, t))]
    _, (r_gh, r_gw, _) = _torch_reference_with_grads(np.asarray(h, np.float64), np.asarray(w, np.float64), ids,
                                                     temp, cts)

    def loss(fn):
        return lambda h, w: sum(jnp.sum(o * jnp.asarray(g, jnp.float32)) for o, g in zip(fn(h, w), cts))

    chunked = lambda h, w: chunked_log_probs_and_entropy(h, w, jnp.asarray(ids), temperature=temp,
                                                         seq_chunk=4, vocab_chunk=vocab_chunk,
                                                         max_saved_logits_bytes=budget)
    naive_fn = lambda h, w: logits_to_log_probs_and_entropy(
        jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32), jnp.asarray(ids), temp)
    gh, gw = jax.jit(jax.grad(loss(chunked), argnums=(0, 1)))(h, w)
    nh, nw = jax.jit(jax.grad(loss(naive_fn), argnums=(0, 1)))(h, w)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.bfloat16
    for got, naive_got, want in ((gh, nh, r_gh), (gw, nw, r_gw)):
        got, naive_got = np.asarray(got, np.float64), np.asarray(naive_got, np.float64)
        np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-3 * np.abs(want).max())
        assert np.abs(got - want).max() <= 1.01 * np.abs(naive_got - want).max() + 1e-6


def _compiled_temp_bytes(fn, *specs):
    return jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("vocab_chunk", [512, None])
def test_backward_holds_no_full_size_float32_head_gradient(monkeypatch, vocab_chunk):
    """Compiled forward+backward with a bf16 head (XLA memory analysis), logits recomputed (budget 0, as at long
    sequences): the temporaries stay below one float32 [D, V] buffer -- no float32 copy of the weight, no [D, V]
    float32 gradient carry, no padded weight copy -- and below 1/8 of the naive path's."""
    monkeypatch.setattr(chunked_module, "BACKWARD_VOCAB_CHUNK", 512)
    b, t, d, v = 1, 256, 64, 8192 + 100  # ragged last vocabulary tile
    specs = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, t), jnp.int32))

    def grad_of(fn):
        return jax.grad(lambda h, w, i: jnp.sum(sum(fn(h, w, i))), argnums=(0, 1))

    chunked = _compiled_temp_bytes(grad_of(lambda h, w, i: chunked_log_probs_and_entropy(
        h, w, i, seq_chunk=16, vocab_chunk=vocab_chunk, max_saved_logits_bytes=0)), *specs)
    full = _compiled_temp_bytes(grad_of(lambda h, w, i: naive(h, w, i, 1.0)), *specs)
    assert chunked < d * v * 4, (chunked, d * v * 4)
    assert chunked < full / 8, (chunked, full)


@pytest.mark.parametrize("budget", [0, None])  # 0: the backward recomputes the logits; None: it keeps them
@pytest.mark.parametrize("seq_chunk,vocab_chunk,bwd_tile", [(4, None, 8192), (5, None, 16), (13, 7, None),
                                                            (16, 10, None)])
def test_vd_layout_equals_dv_layout_on_the_transposed_weight(monkeypatch, seq_chunk, vocab_chunk, bwd_tile, budget):
    """A ``[V, D]`` weight (``weight_layout="vd"``, a tied embedding as stored) gives the values and gradients
    (hidden, weight -- in [V, D] -- and temperature) of the ``[D, V]`` call on its transpose, with collision
    probabilities and ragged tiles on both axes: the same float64 numbers (1e-12), float32 to rounding (the two
    einsums sum in different orders; both are as close to the float64 result: 1e-5, about 20 float32 ulps of a
    log-prob near log(41); a 2-core AMD EPYC Zen 3 (AVX2) differed by 1.9e-6 on one collision probability, which
    1e-6 rejected)."""
    if bwd_tile is not None:
        monkeypatch.setattr(chunked_module, "BACKWARD_VOCAB_CHUNK", bwd_tile)
    rng = np.random.default_rng(7)
    b, t, d, v = 2, 13, 8, 41
    h, emb = rng.normal(size=(b, t, d)), rng.normal(size=(v, d))
    ids = jnp.asarray(rng.integers(0, v, size=(b, t)))
    cts = [rng.normal(size=(b, t)) for _ in range(3)]

    def run(w, layout, dtype):
        def loss(h, w, temperature):
            outs = chunked_log_probs_and_entropy(h, w, ids, temperature=temperature, seq_chunk=seq_chunk,
                                                 vocab_chunk=vocab_chunk, with_collision=True,
                                                 max_saved_logits_bytes=budget, weight_layout=layout)
            return sum(jnp.sum(o * jnp.asarray(g, dtype)) for o, g in zip(outs, cts)), outs

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        (_, outs), grads = f(jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(0.7, dtype))
        return [np.asarray(x) for x in outs], [np.asarray(x) for x in grads]

    for dtype, atol_values, atol_grads in ((jnp.float32, 1e-5, 1e-4), (jnp.float64, 1e-12, 1e-12)):
        with jax.enable_x64(dtype == jnp.float64):
            outs_vd, (gh_vd, gw_vd, gt_vd) = run(emb, "vd", dtype)
            outs_dv, (gh_dv, gw_dv, gt_dv) = run(emb.T, "dv", dtype)
        assert gw_vd.shape == (v, d) and gw_vd.dtype == dtype
        for x, y in zip(outs_vd, outs_dv):
            np.testing.assert_allclose(x, y, atol=atol_values, rtol=atol_values)
        for x, y in ((gh_vd, gh_dv), (gw_vd, gw_dv.T), (gt_vd, gt_dv)):
            np.testing.assert_allclose(x, y, atol=atol_grads, rtol=atol_grads)
    n = naive(jnp.asarray(h, jnp.float32), jnp.asarray(emb.T, jnp.float32), ids, 0.7)  # float32 values above
    np.testing.assert_allclose(outs_vd[0], np.asarray(n[0]), atol=2e-5)
    np.testing.assert_allclose(outs_vd[1], np.asarray(n[1]), atol=2e-5)


@pytest.mark.parametrize("budget", [0, None])
def test_tied_head_hlo_has_no_dv_gradient_or_float32_copy(monkeypatch, budget):
    """Compiled value_and_grad of a tied head (bf16 ``[V, D]`` embedding, ``weight_layout="vd"``), both backward
    modes, several backward vocabulary tiles: the gradient is written as ``[V, D]`` and no array of the
    transposed shape ``[D, V]`` other than in the weight's own dtype exists (no float32 / uint16 ``[D, V]``
    gradient buffer, zero fill or transpose of it back, no float32 copy of the weight), whereas the ``[D, V]``
    call on ``embedding.T`` has such a buffer (so the check can fail). The CPU compiler still makes one bf16 ``[D, V]``
    copy of the weight for the forward's whole-vocabulary dot inside the sequence loop (it makes none for
    the same dot outside a loop); the assertion allows it."""
    monkeypatch.setattr(chunked_module, "BACKWARD_VOCAB_CHUNK", 1024)
    b, t, d, v = 1, 48, 64, 4096
    specs = (jax.ShapeDtypeStruct((b, t, d), jnp.bfloat16), jax.ShapeDtypeStruct((v, d), jnp.bfloat16),
             jax.ShapeDtypeStruct((b, t), jnp.int32))

    def dv_dtypes(layout):
        def loss(h, emb, i):
            w = emb if layout == "vd" else emb.T
            return jnp.sum(sum(chunked_log_probs_and_entropy(h, w, i, seq_chunk=16, max_saved_logits_bytes=budget,
                                                             weight_layout=layout)))

        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*specs).compile().as_text()
        assert f"ROOT %tuple" in text and f"bf16[{v},{d}]" in text  # the [V, D] gradient
        return {m.group(1) for m in re.finditer(rf"\b(\w+)\[{d},{v}\]", text)}

    assert dv_dtypes("vd") <= {"bf16"}, dv_dtypes("vd")
    # the control: the [D, V] call has a non-bf16 [D, V] buffer (f32 and u16 with jax 0.10's XLA; u16 alone with
    # jax 0.12's), so the assertion above can fail
    assert dv_dtypes("dv") - {"bf16"}, dv_dtypes("dv")


def test_bad_inputs():
    with pytest.raises(ValueError, match="token_ids"):
        logits_to_log_probs(jnp.zeros((2, 3, 5)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="temperature"):
        logits_to_log_probs(jnp.zeros((2, 5)), jnp.zeros((2,), jnp.int32), 0.0)
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((4, 5)), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="weight_layout"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((3, 5)), jnp.zeros((1, 2), jnp.int32),
                                      weight_layout="vd")
    with pytest.raises(ValueError, match="weight_layout"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((5, 3)), jnp.zeros((1, 2), jnp.int32),
                                      weight_layout="VD")
    with pytest.raises(ValueError, match="token_ids"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((3, 5)), jnp.zeros((1, 2)))
    with pytest.raises(ValueError, match="seq_chunk"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((3, 5)), jnp.zeros((1, 2), jnp.int32),
                                      seq_chunk=0)
    with pytest.raises(ValueError, match="vocab_chunk"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((3, 5)), jnp.zeros((1, 2), jnp.int32),
                                      vocab_chunk=-1)
    with pytest.raises(ValueError, match="max_saved_logits_bytes"):
        chunked_log_probs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((3, 5)), jnp.zeros((1, 2), jnp.int32),
                                      max_saved_logits_bytes=-1)


@pytest.mark.parametrize("budget", [0, None])
@pytest.mark.parametrize("seq_chunk,vocab_chunk,with_collision", [(4, None, False), (13, 7, True), (5, None, True),
                                                                  (16, 10, False)])
def test_without_entropy_values_and_gradients_match_torch_float64(seq_chunk, vocab_chunk, with_collision, budget):
    """``calculate_entropy=False`` (verl's flag): entropy None, log-probs (and C') and every gradient equal the
    PyTorch autograd reference of a loss without an entropy term; the forward has no E_p[z] pass."""
    rng = np.random.default_rng(7)
    b, t, d, v, temp = 2, 13, 8, 41, 0.9
    h, w = rng.normal(size=(b, t, d)), rng.normal(size=(d, v)) * 0.8
    ids = rng.integers(0, v, size=(b, t))
    cts = [rng.normal(size=(b, t)), np.zeros((b, t)), rng.normal(size=(b, t)) * with_collision]
    (r_lp, _, r_col), (r_gh, r_gw, r_gt) = _torch_reference_with_grads(h, w, ids, temp, cts)
    with jax.enable_x64(True):
        def head(h, w, temperature, calculate_entropy=False):
            return chunked_log_probs_and_entropy(h, w, jnp.asarray(ids), temperature=temperature,
                                                 seq_chunk=seq_chunk, vocab_chunk=vocab_chunk,
                                                 with_collision=with_collision, max_saved_logits_bytes=budget,
                                                 calculate_entropy=calculate_entropy)

        def loss(h, w, temperature):
            outs = head(h, w, temperature)
            assert outs[1] is None and len(outs) == 2 + with_collision
            total = jnp.sum(outs[0] * cts[0]) + (jnp.sum(outs[2] * cts[2]) if with_collision else 0.0)
            return total, outs

        args = (jnp.asarray(h), jnp.asarray(w), jnp.asarray(temp))
        (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
        with_ent, without = (str(jax.make_jaxpr(functools.partial(head, calculate_entropy=c))(*args))
                             for c in (True, False))
    np.testing.assert_allclose(np.asarray(outs[0]), r_lp, atol=1e-11)
    if with_collision:
        np.testing.assert_allclose(np.asarray(outs[2]), r_col, atol=1e-11)
    for got, want in zip(grads, (r_gh, r_gw, r_gt)):
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-10, rtol=1e-10)
    # the entropy's E_p[z] pass: a full-precision dot (whole-vocabulary tiles) or a running sum (streaming)
    assert without.count("dot_general") < with_ent.count("dot_general") or \
        without.count("reduce_sum") < with_ent.count("reduce_sum")


def test_without_entropy_empty_sequence():
    h, w = jnp.zeros((2, 0, 4)), jnp.zeros((4, 6))
    lp, ent = chunked_log_probs_and_entropy(h, w, jnp.zeros((2, 0), jnp.int32), calculate_entropy=False)
    assert lp.shape == (2, 0) and ent is None
