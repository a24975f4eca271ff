"""The rollout engine keeps its per-layer decode copy in the dtype the forward pass reads the layers in
(``models.decode.decode_layer_dtype``): bfloat16 for bf16 compute over float32 master weights, the paper configs'
setting. Half the engine's memory, and bitwise the same rollouts and log-probs as a float32 copy."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fixtures_rollout import RAGGED_PROMPTS, make_engine, tiny_config, tiny_model
from models.decode import decode_layer_dtype, split_layers
from stapo_jax.rollout import engine as engine_module
from stapo_jax.rollout.driver import RolloutDriver
from stapo_jax.rollout.sampling import SamplingParams

BF16 = dict(dtype="bfloat16", param_dtype="float32")


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_the_layer_dtype_is_the_compute_dtype_only_when_narrower():
    assert decode_layer_dtype(tiny_config(**BF16)) == jnp.bfloat16
    assert decode_layer_dtype(tiny_config(dtype="float32", param_dtype="float32")) is None
    assert decode_layer_dtype(tiny_config(dtype="bfloat16", param_dtype="bfloat16")) is None
    assert decode_layer_dtype(tiny_config(dtype="float32", param_dtype="bfloat16")) is None  # read as stored


@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_k=20)])
def test_bf16_layers_give_bitwise_the_rollouts_of_float32_layers(monkeypatch, sampling):
    model = tiny_model(0, **BF16)
    eng = make_engine(model, sampling=sampling)
    layers, rest = eng.load_params().layers, eng.load_params().rest
    assert {x.dtype for x in jax.tree.leaves(layers)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(rest)} == {jnp.dtype(jnp.float32)}  # embedding, norm, LM head
    got = RolloutDriver(eng).generate(RAGGED_PROMPTS, max_new_tokens=12, seed=3)

    monkeypatch.setattr(engine_module, "decode_layer_dtype", lambda config: None)  # the engine as it was
    ref_eng = make_engine(model, sampling=sampling)
    ref_layers = ref_eng.load_params().layers
    assert {x.dtype for x in jax.tree.leaves(ref_layers)} == {jnp.dtype(jnp.float32)}
    assert _bytes(layers) * 2 == _bytes(ref_layers)
    want = RolloutDriver(ref_eng).generate(RAGGED_PROMPTS, max_new_tokens=12, seed=3)

    np.testing.assert_array_equal(got.responses, want.responses)
    np.testing.assert_array_equal(got.response_lengths, want.response_lengths)
    np.testing.assert_array_equal(got.rollout_log_probs, want.rollout_log_probs)
    assert got.rollout_log_probs.min() < -0.01  # real log-probs, not a degenerate run


def test_weight_sync_casts_into_the_engine_buffers_in_place():
    eng = make_engine(tiny_model(0, **BF16))
    addresses = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(eng.load_params().layers)]
    other = nnx.split(tiny_model(1, **BF16))[1]
    synced = eng.set_params(other)
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(synced.layers)] == addresses
    want = split_layers(other, kernel_layout=eng.kernel_layout, layer_dtype=jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(synced.layers), jax.tree.leaves(want.layers), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stacked = np.asarray(other["layers"]["mlp"]["up_proj"]["kernel"][...])[1]  # [in, out], float32
    got = np.asarray(synced.layers[1]["mlp"]["up_proj"]["kernel"][...], np.float32)
    np.testing.assert_array_equal(got.T if eng.kernel_layout == "out_in" else got,
                                  stacked.astype(jnp.bfloat16).astype(np.float32))
