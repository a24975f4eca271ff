"""models/hf.py + models/qwen3.py + models/decode.py against transformers' PyTorch Qwen3ForCausalLM (fp32)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from fixtures_hf import hf_logits, hf_tied, hf_untied_sharded, padded_batch  # noqa: F401 (fixtures)
from models.decode import decode_step, greedy_generate, prefill
from models.hf import iter_hf_tensors, load_hf_checkpoint, resolve_checkpoint, save_hf_checkpoint
from stapo_jax.core.errors import CheckpointError
from models.kv_cache import init_cache
from xla_env import xla_flags

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4


def our_logits(model, ids, mask):
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool))
    return np.asarray(model.logits(hidden))


@pytest.mark.parametrize("which", ["hf_tied", "hf_untied_sharded"])
def test_logits_match_hf_with_padding_and_ragged_lengths(which, request):
    hf_model, path = request.getfixturevalue(which)
    cfg, model = load_hf_checkpoint(path)
    assert cfg.tie_word_embeddings == (which == "hf_tied")
    assert (model.lm_head is None) == cfg.tie_word_embeddings
    ids, mask = padded_batch()
    ref = hf_logits(hf_model, ids, mask)
    ours = our_logits(model, ids, mask)
    valid = mask.astype(bool)
    assert ref.shape == ours.shape == (4, 12, cfg.vocab_size)
    assert np.abs(ref[valid]).max() > 1.0          # a non-degenerate model
    assert np.abs(ours[valid] - ref[valid]).max() <= TOL
    # the same row unpadded gives the same per-token logits (padding is masked, positions from the mask)
    row = ids[2, mask[2] == 1][None]
    alone = our_logits(model, row, np.ones_like(row))
    assert np.abs(alone[0] - ours[2, mask[2] == 1]).max() <= TOL


def test_sharded_index_checkpoint_is_what_hf_wrote(hf_untied_sharded):
    _, path = hf_untied_sharded
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and "lm_head.weight" in index["weight_map"]
    assert sorted(p.name for p in path.glob("*.safetensors")) == sorted(shards)


def test_kv_cache_decoding_16_tokens_equals_hf_full_forward(hf_tied):
    hf_model, path = hf_tied
    cfg, model = load_hf_checkpoint(path)
    ids, mask = padded_batch(seed=3, t=8)
    ids, mask = ids[:3], mask[:3]                    # left-padded prompts of ragged lengths
    cont = np.random.default_rng(4).integers(3, cfg.vocab_size, size=(3, 16))
    full_ids = np.concatenate([ids, cont], 1)
    full_mask = np.concatenate([mask, np.ones_like(cont)], 1)
    ref = hf_logits(hf_model, full_ids, full_mask)   # [3, 24, V]

    from flax import nnx
    graphdef, state = nnx.split(model)
    cache = init_cache(cfg, 3, 24)
    logits, cache = prefill(graphdef, state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool), cache)
    got = [np.asarray(logits)]
    for i in range(15):
        logits, cache = decode_step(graphdef, state, jnp.asarray(cont[:, i], jnp.int32), cache)
        got.append(np.asarray(logits))
    got = np.stack(got, 1)                           # predicts positions 8..23
    assert np.abs(got - ref[:, 7:23]).max() <= TOL
    assert np.asarray(cache.length).tolist() == [23, 23, 23]
    assert np.asarray(cache.next_position).tolist() == (mask.sum(1) + 15).tolist()


@pytest.mark.parametrize("with_eos", [False, True])
def test_greedy_continuation_equals_hf_generate(hf_untied_sharded, with_eos):
    hf_model, path = hf_untied_sharded
    cfg, model = load_hf_checkpoint(path)
    ids, mask = padded_batch(seed=5, t=8)
    ids, mask = ids[:3], mask[:3]
    n = 16

    def hf_generate(eos):
        with torch.no_grad():
            out = hf_model.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                                    max_new_tokens=n, min_new_tokens=0, do_sample=False, pad_token_id=0,
                                    eos_token_id=eos, bos_token_id=None, use_cache=True)
        return out[:, ids.shape[1]:].numpy()

    free = hf_generate(None)
    assert free.shape == (3, n)
    eos = [int(free[0, 5])] if with_eos else []      # a token row 0 really emits at step 6
    ref = hf_generate(eos or None)
    tokens, lengths = greedy_generate(model, ids, mask, n, eos_token_ids=eos)
    for b in range(3):
        stop = n
        if eos:
            hits = np.flatnonzero(ref[b] == eos[0])
            stop = int(hits[0]) + 1 if hits.size else n
        assert lengths[b] == stop
        assert tokens[b, :stop].tolist() == ref[b, :stop].tolist()
    if with_eos:
        assert lengths[0] <= 6


@pytest.mark.parametrize("which", ["hf_tied", "hf_untied_sharded"])
def test_export_then_hf_from_pretrained_gives_identical_logits(which, request, tmp_path):
    hf_model, path = request.getfixturevalue(which)
    cfg, model = load_hf_checkpoint(path)
    files = save_hf_checkpoint(model, cfg, tmp_path / "out", max_shard_size=50_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and len(files) > 3
    assert ("lm_head.weight" in index["weight_map"]) == (not cfg.tie_word_embeddings)
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    ids, mask = padded_batch(seed=6)
    np.testing.assert_array_equal(hf_logits(reloaded, ids, mask), hf_logits(hf_model, ids, mask))
    ref_sd = hf_model.state_dict()
    for name, t in reloaded.state_dict().items():
        np.testing.assert_array_equal(t.numpy(), ref_sd[name].numpy(), err_msg=name)


def test_single_file_export_and_bf16_round_trip(hf_tied, tmp_path):
    hf_model, path = hf_tied
    hf_model_bf16 = transformers.Qwen3ForCausalLM(hf_model.config).eval()
    hf_model_bf16.load_state_dict(hf_model.state_dict())
    hf_model_bf16 = hf_model_bf16.to(torch.bfloat16)
    hf_model_bf16.save_pretrained(tmp_path / "bf16")
    cfg, model = load_hf_checkpoint(tmp_path / "bf16")          # bf16 on disk -> exact f32 upcast
    q = np.asarray(model.layers.self_attn.q_proj.kernel[...])
    want = hf_model_bf16.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
    assert q.dtype == np.float32
    np.testing.assert_array_equal(q[1], want)
    files = save_hf_checkpoint(model, cfg, tmp_path / "out", dtype="bfloat16")
    assert [f.name for f in files] == ["model.safetensors", "config.json"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ours = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(tmp_path / "bf16" / "model.safetensors")
    assert set(ours) == set(theirs)
    for k in theirs:
        assert ours[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(ours[k].view(np.uint16), theirs[k].view(np.uint16), err_msg=k)


def test_iter_hf_tensors_names_and_layouts(hf_untied_sharded):
    hf_model, path = hf_untied_sharded
    cfg, model = load_hf_checkpoint(path)
    sd = hf_model.state_dict()
    names = []
    for name, arr in iter_hf_tensors(model, cfg):
        names.append(name)
        np.testing.assert_array_equal(arr, sd[name].numpy(), err_msg=name)
    assert sorted(names) == sorted(sd)


# ------------------------------------------------------------------------------------------- bad checkpoints
def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_config_that_is_not_qwen3_is_rejected(hf_tied, tmp_path):
    ck = _copy_checkpoint(hf_tied[1], tmp_path / "ck")
    d = json.loads((ck / "config.json").read_text())
    d.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (ck / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"config\.json.*not a Qwen3 checkpoint.*'llama'"):
        load_hf_checkpoint(ck)


def _rewrite(ck: Path, fn):
    f = ck / "model.safetensors"
    with safe_open(f, framework="numpy") as h:
        meta = h.metadata()
    tensors = fn(load_file(f))
    save_file(tensors, f, metadata=meta)
    return f


def test_missing_tensor_names_tensor_shape_and_file(hf_tied, tmp_path):
    ck = _copy_checkpoint(hf_tied[1], tmp_path / "ck")
    name = "model.layers.1.mlp.up_proj.weight"
    f = _rewrite(ck, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(ck)
    msg = str(e.value)
    assert name in msg and "missing" in msg and "[128, 64]" in msg and str(f) in msg


@pytest.mark.parametrize("keep_bytes", [5000, 4])
def test_truncated_safetensors_names_the_file(hf_tied, tmp_path, keep_bytes):
    """A copy cut short (inside the tensor data, or inside the header's length prefix) is a CheckpointError that
    names the file, not safetensors' bare header error."""
    ck = _copy_checkpoint(hf_tied[1], tmp_path / "ck")
    f = ck / "model.safetensors"
    f.write_bytes(f.read_bytes()[:keep_bytes])
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as e:
        load_hf_checkpoint(ck)
    assert str(f) in str(e.value) and "truncated" in str(e.value)


def test_wrong_shape_names_tensor_both_shapes_and_file(hf_tied, tmp_path):
    ck = _copy_checkpoint(hf_tied[1], tmp_path / "ck")
    name = "model.layers.0.self_attn.k_proj.weight"
    f = _rewrite(ck, lambda t: {**t, name: np.zeros((16, 64), np.float32)})
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(ck)
    msg = str(e.value)
    assert name in msg and str(f) in msg and "[16, 64]" in msg and "expected [32, 64]" in msg


def test_untied_config_without_lm_head_is_rejected(hf_tied, tmp_path):
    ck = _copy_checkpoint(hf_tied[1], tmp_path / "ck")
    d = json.loads((ck / "config.json").read_text())
    d["tie_word_embeddings"] = False
    (ck / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' is missing \(expected shape \[320, 64\]"):
        load_hf_checkpoint(ck)


def test_index_listing_a_tensor_its_shard_lacks(hf_untied_sharded, tmp_path):
    ck = _copy_checkpoint(hf_untied_sharded[1], tmp_path / "ck")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    shard = ck / index["weight_map"][name]
    with safe_open(shard, framework="numpy") as h:
        meta = h.metadata()
    save_file({k: v for k, v in load_file(shard).items() if k != name}, shard, metadata=meta)
    with pytest.raises(CheckpointError, match=rf"{shard.name}.*'model\.norm\.weight'.*\[64\]"):
        load_hf_checkpoint(ck)


def test_no_safetensors_and_no_such_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **{
        "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 1, "head_dim": 8, "rope_theta": 1e4}}))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        load_hf_checkpoint(tmp_path / "nope" / "deeper")


def test_hub_id_offline_gives_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="Hugging Face Hub failed"):
        resolve_checkpoint("Qwen/Qwen3-0.6B")


def test_export_refuses_to_mix_into_an_existing_checkpoint(hf_tied):
    cfg, model = load_hf_checkpoint(hf_tied[1])
    with pytest.raises(CheckpointError, match="already holds safetensors"):
        save_hf_checkpoint(model, cfg, hf_tied[1])


def test_load_and_export_do_not_import_torch(hf_tied, tmp_path):
    code = (
        "import sys\n"
        "from models.hf import load_hf_checkpoint, save_hf_checkpoint\n"
        f"cfg, m = load_hf_checkpoint({str(hf_tied[1])!r})\n"
        f"save_hf_checkpoint(m, cfg, {str(tmp_path / 'out')!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags()}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith("ok")
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_unexpected_tensors_raise_unless_not_strict(hf_tied, tmp_path):
    ck = _copy_checkpoint(hf_tied[1], tmp_path / "ck")
    extra = {f"model.layers.2.mlp.extra_{i:02d}.weight": np.full((3,), i, np.float32) for i in range(11)}
    extra["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((8,), np.float32)
    _rewrite(ck, lambda t: {**t, **extra})
    with pytest.raises(CheckpointError) as e:
        load_hf_checkpoint(ck)
    msg = str(e.value)
    names = sorted(extra)
    assert "12 tensor(s) that the Qwen3 model (num_hidden_layers=2" in msg
    assert all(f"{n!r} (model.safetensors)" in msg for n in names[:10])
    assert names[10] not in msg and names[11] not in msg and "and 2 more" in msg and "strict=False" in msg
    with pytest.warns(UserWarning, match="12 tensor.*ignored"):
        cfg, model = load_hf_checkpoint(ck, strict=False)
    ids, mask = padded_batch()
    valid = mask.astype(bool)
    assert np.abs(our_logits(model, ids, mask)[valid] - hf_logits(hf_tied[0], ids, mask)[valid]).max() <= TOL
