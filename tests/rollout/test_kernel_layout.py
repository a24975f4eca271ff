"""The rollout engine's decode kernel layout (``EngineConfig.kernel_layout``): the per-layer decode copy may hold
each linear kernel transposed ([out, in], PyTorch's layout) because XLA:CPU reads it faster in skinny matmuls.
Both layouts must give the trainer's numbers; the weight sync must write the transposed kernels in place."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fixtures_rollout import RAGGED_PROMPTS, make_engine, tiny_model
from models.decode import copy_layer_into, greedy_generate, split_layers
from models.linear import Linear, cpu_info, preferred_kernel_layout, set_kernel_layout
from models.sharding import make_mesh, param_path
from stapo_jax.rollout.decode_fns import decode_param_shardings, resolve_kernel_layout
from stapo_jax.rollout.driver import RolloutDriver
from stapo_jax.rollout.engine import EngineConfig, EngineConfigError, Qwen3Engine
from stapo_jax.rollout.sampling import SamplingParams


def _engine(model, layout, sampling=SamplingParams(greedy=True)):
    eng = make_engine(model, sampling=sampling)
    cfg = dataclasses.replace(eng.config, kernel_layout=layout)
    return Qwen3Engine(model, cfg)


def test_linear_out_in_equals_in_out():
    lin = Linear(6, 5, use_bias=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 2, 6))
    want = x @ lin.kernel[...]
    assert jnp.abs(lin(x) - want).max() < 1e-6
    lin.kernel = nnx.Param(lin.kernel[...].T)
    set_kernel_layout(lin, "out_in")
    got = lin(x)
    assert got.shape == (3, 2, 5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="kernel_layout"):
        set_kernel_layout(lin, "io")


def test_split_layers_transposes_only_the_kernels():
    state = nnx.split(tiny_model(0))[1]
    dp = split_layers(state, kernel_layout="out_in")
    assert dp.kernel_layout == "out_in"
    stacked = {param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(state["layers"])[0]}
    for i, layer in enumerate(dp.layers):
        for p, x in jax.tree_util.tree_flatten_with_path(layer)[0]:
            name = param_path(p)
            want = np.asarray(stacked[name][i])
            np.testing.assert_array_equal(np.asarray(x), want.T if name.endswith(".kernel") else want)
    assert sum(param_path(p).endswith(".kernel") for p, _ in jax.tree_util.tree_flatten_with_path(dp.layers[0])[0]) == 7
    # copy_layer_into writes the same transposed values into an existing per-layer state
    copied = copy_layer_into(state["layers"], jnp.int32(1), jax.tree.map(jnp.zeros_like, dp.layers[1]), "out_in")
    for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(dp.layers[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="kernel_layout"):
        split_layers(state, kernel_layout="transposed")


@pytest.mark.parametrize("sampling", [SamplingParams(greedy=True), SamplingParams(temperature=0.8, top_k=20)])
def test_both_layouts_give_the_same_rollouts_and_log_probs(sampling):
    model = tiny_model(0)
    runs = {}
    for layout in ("in_out", "out_in"):
        eng = _engine(model, layout, sampling)
        assert eng.kernel_layout == layout and eng.load_params().kernel_layout == layout
        runs[layout] = RolloutDriver(eng).generate(RAGGED_PROMPTS, max_new_tokens=12, seed=3)
    a, b = runs["in_out"], runs["out_in"]
    np.testing.assert_array_equal(a.responses, b.responses)
    np.testing.assert_array_equal(a.response_lengths, b.response_lengths)
    np.testing.assert_allclose(a.rollout_log_probs, b.rollout_log_probs, rtol=1e-5, atol=1e-5)
    lp = a.rollout_log_probs
    assert np.isfinite(lp).all() and (lp <= 0).all() and lp.min() < -0.01


def test_weight_sync_writes_transposed_kernels_in_place():
    eng = _engine(tiny_model(0), "out_in")
    first = eng.load_params()
    addresses = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(first.layers)]
    other = nnx.split(tiny_model(1))[1]
    synced = eng.set_params(other)
    assert synced.kernel_layout == "out_in"
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(synced.layers)] == addresses
    want = split_layers(other, kernel_layout="out_in")
    for a, b in zip(jax.tree.leaves(synced), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    after = RolloutDriver(eng).generate(RAGGED_PROMPTS, max_new_tokens=6)
    ref = RolloutDriver(_engine(tiny_model(1), "in_out")).generate(RAGGED_PROMPTS, max_new_tokens=6)
    np.testing.assert_array_equal(after.responses, ref.responses)


def test_greedy_generate_layouts_agree():
    model = tiny_model(2)
    ids = jnp.asarray([[5, 9, 3, 0], [7, 1, 2, 4]], jnp.int32)
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1]], bool)
    tokens, lengths = greedy_generate(model, ids, mask, 6)
    graphdef, state = nnx.split(model)
    from models.decode import decode_step, prefill
    from models.kv_cache import init_cache

    for layout in ("in_out", "out_in"):
        params = split_layers(state, kernel_layout=layout)
        logits, cache = prefill(graphdef, params, ids, mask, init_cache(model.config, 2, 10))
        assert (jnp.argmax(logits, -1) == tokens[:, 0]).all()
        logits, _ = decode_step(graphdef, params, jnp.asarray(tokens[:, 0]), cache)
        assert (jnp.argmax(logits, -1) == tokens[:, 1]).all()
    assert lengths.tolist() == [6, 6]


def test_cpu_info_reads_the_first_processor_block(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu avx2 avx512f\n\n"
                    "processor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: sse2\n")
    assert cpu_info(str(info)) == ("AuthenticAMD", frozenset({"fpu", "avx2", "avx512f"}))
    info.write_text("processor\t: 0\nmodel name\t: some ARM core\n")
    assert cpu_info(str(info)) == ("", frozenset())
    assert cpu_info(str(tmp_path / "missing")) == ("", frozenset())


def test_auto_layout_and_config_errors():
    zen3, zen4 = frozenset({"avx", "avx2"}), frozenset({"avx", "avx2", "avx512f"})
    assert preferred_kernel_layout("cpu", "GenuineIntel", zen4) == "out_in"
    assert preferred_kernel_layout("cpu", "GenuineIntel", zen3) == "out_in"
    assert preferred_kernel_layout("cpu", "AuthenticAMD", zen4) == "in_out"
    assert preferred_kernel_layout("cpu", "AuthenticAMD", zen3) == preferred_kernel_layout("cpu", "", zen4) == "out_in"
    assert preferred_kernel_layout("gpu") == preferred_kernel_layout("tpu") == "in_out"
    vendor, flags = cpu_info()
    here = "in_out" if vendor == "AuthenticAMD" and "avx512f" in flags else "out_in"
    assert preferred_kernel_layout("cpu") == here
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    assert resolve_kernel_layout("auto", mesh) == here  # the tests run on CPU devices
    assert resolve_kernel_layout("in_out", mesh) == "in_out"
    with pytest.raises(ValueError, match="kernel_layout"):
        resolve_kernel_layout("columns", mesh)
    with pytest.raises(EngineConfigError, match="kernel_layout"):
        EngineConfig(kernel_layout="columns")
    assert make_engine(tiny_model(0)).kernel_layout == here  # default "auto" on CPU


def test_out_in_shardings_reverse_the_kernel_specs():
    mesh = make_mesh(2, 2, 2)
    stacked = nnx.State({"layers": {"mlp": {"up_proj": {"kernel": NamedSharding(mesh, P(None, "fsdp", "tensor"))},
                                            "down_proj": {"kernel": NamedSharding(mesh, P(None, "tensor"))}},
                                    "input_layernorm": {"weight": NamedSharding(mesh, P(None, "fsdp"))}},
                         "norm": {"weight": NamedSharding(mesh, P())}})
    layer = decode_param_shardings(stacked, 3, "out_in").layers[0]
    assert layer["mlp"]["up_proj"]["kernel"].spec == P("tensor", "fsdp")
    assert layer["mlp"]["down_proj"]["kernel"].spec == P(None, "tensor")
    assert layer["input_layernorm"]["weight"].spec == P("fsdp")
    same = decode_param_shardings(stacked, 3, "in_out").layers[0]
    assert same["mlp"]["up_proj"]["kernel"].spec == P("fsdp", "tensor")


def test_rollout_kernel_layout_config_key():
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.config.schema import load_config
    from stapo_jax.rollout import engine_config

    base = "configs/tiny_cpu.yaml"
    assert engine_config(load_config(base)).kernel_layout == "auto"
    assert engine_config(load_config(base, ["rollout.kernel_layout=in_out"])).kernel_layout == "in_out"
    with pytest.raises(ConfigError, match="rollout.kernel_layout"):
        load_config(base, ["rollout.kernel_layout=columns"])
