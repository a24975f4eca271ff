"""models/sharding.py: mesh construction, partition rules, activation constraints, and a forward pass on a
(data=2, fsdp=2, tensor=2) mesh of 8 simulated CPU devices equal to one device and to HF.

The 8 host devices come from tests/conftest.py (XLA_FLAGS=--xla_force_host_platform_device_count=8, set before
jax is imported)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from fixtures_hf import hf_logits, hf_untied_sharded, padded_batch  # noqa: F401 (fixture)
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.presets import preset
from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from models.sharding import (ShardingError, constrain, describe, make_mesh, param_shardings, param_specs,
                             shard_model)

TINY = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
                   tie_word_embeddings=True)


def _need_8_devices():
    assert jax.device_count() == 8, (
        f"tests/models/test_sharding.py needs 8 host devices, found {jax.device_count()}: run through pytest so "
        "tests/conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported, and do "
        "not set that flag in your own XLA_FLAGS (yours wins)")


def _abstract_state(cfg):
    return nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))[1]


def test_make_mesh_sizes_and_errors():
    _need_8_devices()
    assert dict(make_mesh().shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert dict(make_mesh(data=2, fsdp=-1, tensor=2).shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(make_mesh(data=1, fsdp=2, tensor=1, devices=jax.devices()[:2]).shape)["fsdp"] == 2
    with pytest.raises(ShardingError, match="does not divide the 8 devices"):
        make_mesh(data=-1, fsdp=3)
    with pytest.raises(ShardingError, match="multiply to 4, but there are 8 devices"):
        make_mesh(data=2, fsdp=2, tensor=1)
    with pytest.raises(ShardingError, match="at most one axis may be -1"):
        make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ShardingError, match="positive"):
        make_mesh(data=0, fsdp=-1)


def test_partition_rules_for_qwen3_0_6b():
    specs = describe_specs(preset("Qwen3-0.6B"), {"data": 2, "fsdp": 4, "tensor": 8})
    assert specs["embed_tokens.embedding"] == P("tensor", "fsdp")                 # [V, D]
    assert specs["layers.self_attn.q_proj.kernel"] == P(None, "fsdp", "tensor")   # 16 heads / 8
    assert specs["layers.self_attn.k_proj.kernel"] == P(None, "fsdp", "tensor")   # 8 kv heads / 8
    assert specs["layers.self_attn.o_proj.kernel"] == P(None, "tensor", "fsdp")
    assert specs["layers.mlp.gate_proj.kernel"] == P(None, "fsdp", "tensor")
    assert specs["layers.mlp.down_proj.kernel"] == P(None, "tensor", "fsdp")
    assert specs["layers.self_attn.q_norm.weight"] == P(None, None)
    assert specs["norm.weight"] == P(None)
    assert "lm_head.kernel" not in specs                                          # tied


def test_rules_fall_back_to_replication_when_an_axis_does_not_divide():
    # 8 KV heads on tensor=16: 1024 divides by 16 but a head (128) would be split -> replicated;
    # 32 query heads on 16 -> sharded. tensor=3 divides nothing -> replicated everywhere.
    specs = describe_specs(preset("Qwen3-8B"), {"data": 1, "fsdp": 2, "tensor": 16})
    assert specs["layers.self_attn.q_proj.kernel"] == P(None, "fsdp", "tensor")
    assert specs["layers.self_attn.k_proj.kernel"] == P(None, "fsdp", None)
    assert specs["lm_head.kernel"] == P("fsdp", "tensor")                         # untied 8B
    specs = describe_specs(preset("Qwen3-14B"), {"data": 1, "fsdp": 3, "tensor": 3})
    assert specs["layers.mlp.up_proj.kernel"] == P(None, None, None)               # 5120 % 3, 17408 % 3
    assert specs["embed_tokens.embedding"] == P(None, None)                        # 151936 % 3


def describe_specs(cfg, sizes):
    specs = param_specs(_abstract_state(cfg), sizes)
    leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    from models.sharding import param_path
    return {param_path(p): s for p, s in leaves}


def test_unknown_parameter_has_no_rule():
    state = nnx.state(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ShardingError, match="no partition rule matches parameter 'bias'"):
        param_specs(state, {"data": 1, "fsdp": 1, "tensor": 1})


def test_constrain_is_identity_without_mesh_and_tolerates_indivisible_dims():
    _need_8_devices()
    x = jnp.ones((1, 4, 6))
    assert constrain(x, ("batch", None, "heads")) is x
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with jax.set_mesh(mesh):
        y = jax.jit(lambda a: constrain(a * 2, ("batch", None, "heads")))(x)     # batch 1 on data*fsdp=4
        z = jax.jit(lambda a: constrain(a, ("batch", None, "mlp")))(jnp.ones((4, 3, 6)))
    np.testing.assert_array_equal(np.asarray(y), 2 * np.ones((1, 4, 6)))
    assert z.sharding.spec == P(("data", "fsdp"), None, "tensor")


def _forward(graphdef):
    @jax.jit
    def fwd(state, ids, mask):
        model = nnx.merge(graphdef, state)
        hidden, _ = model(ids, mask)
        return model.logits(hidden)
    return fwd


def test_sharded_load_and_forward_equal_single_device_and_hf(hf_untied_sharded):
    _need_8_devices()
    hf_model, path = hf_untied_sharded
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    cfg, sharded = load_hf_checkpoint(path, mesh=mesh)
    _, single = load_hf_checkpoint(path)

    # loaded straight into the NamedShardings: every device holds only its slice
    q = sharded.layers.self_attn.q_proj.kernel[...]
    assert q.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor"))
    assert {s.data.shape for s in q.addressable_shards} == {(2, 32, 32)}
    emb = sharded.embed_tokens.embedding[...]
    assert {s.data.shape for s in emb.addressable_shards} == {(160, 32)}
    np.testing.assert_array_equal(np.asarray(q), np.asarray(single.layers.self_attn.q_proj.kernel[...]))

    ids, mask = padded_batch(seed=7)
    graphdef, state = nnx.split(sharded)
    batch = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        got = _forward(graphdef)(state, jax.device_put(jnp.asarray(ids, jnp.int32), batch),
                                 jax.device_put(jnp.asarray(mask, bool), batch))
    graphdef1, state1 = nnx.split(single)
    want = _forward(graphdef1)(state1, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool))
    valid = mask.astype(bool)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-5
    assert np.abs(np.asarray(got)[valid] - hf_logits(hf_model, ids, mask)[valid]).max() <= 1e-4


def test_export_from_a_sharded_model_equals_hf_weights(hf_untied_sharded, tmp_path):
    _need_8_devices()
    hf_model, path = hf_untied_sharded
    cfg, sharded = load_hf_checkpoint(path, mesh=make_mesh(data=2, fsdp=2, tensor=2))
    save_hf_checkpoint(sharded, cfg, tmp_path / "out")
    ours = load_file(tmp_path / "out" / "model.safetensors")
    ref = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert set(ours) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)


def test_shard_model_moves_a_random_model_without_changing_it():
    _need_8_devices()
    model = Qwen3(TINY, rngs=nnx.Rngs(3))
    ids, mask = padded_batch(seed=8)
    graphdef, state = nnx.split(model)
    want = np.asarray(_forward(graphdef)(state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)))
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    shard_model(model, mesh)
    k = model.layers.mlp.down_proj.kernel[...]
    assert k.sharding == NamedSharding(mesh, P(None, "tensor", "fsdp"))
    shardings = param_shardings(nnx.state(model), mesh)
    assert describe(nnx.state(model), mesh)["layers.mlp.down_proj.kernel"] == str(P(None, "tensor", "fsdp"))
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        got = np.asarray(_forward(graphdef)(state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool)))
    assert np.abs(got - want).max() <= 1e-5
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
