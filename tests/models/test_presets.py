"""Presets vs the real HF config.json files shipped in stapo_jax/assets/qwen3_configs, and parameter counts vs
transformers' ``Qwen3ForCausalLM`` built on torch's meta device (no allocation on either side)."""
import json

import pytest
import torch
import transformers

from models.presets import PRESET_NAMES, from_hf_config, preset
from stapo_jax.assets import qwen3_config_dir
from models.qwen3 import param_count
from models.qwen3_config import Qwen3Config

CONFIG_DIR = qwen3_config_dir()
SHARED_FILES = sorted(CONFIG_DIR.glob("*.json"))
ARCH_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
               "max_position_embeddings", "bos_token_id", "eos_token_id")


def test_shared_config_dir_holds_the_seven_files():
    assert {f.stem for f in SHARED_FILES} == set(PRESET_NAMES) - {"Qwen3-0.6B-Base"}


@pytest.mark.parametrize("path", SHARED_FILES, ids=lambda p: p.stem)
def test_embedded_preset_equals_shared_hf_config(path):
    raw = json.loads(path.read_text())
    ours = preset(path.stem)
    for field in ARCH_FIELDS:
        assert getattr(ours, field) == raw[field], field
    assert from_hf_config(path.stem) == ours              # by name, from the default dir
    assert from_hf_config(path) == ours                   # by user path
    assert from_hf_config(path.stem, config_dir=CONFIG_DIR) == ours


def test_0_6b_base_differs_from_0_6b_only_in_eos_and_context():
    base, inst = preset("Qwen3-0.6B-Base"), preset("Qwen3-0.6B")
    base_ref = json.loads((CONFIG_DIR / "Qwen3-1.7B-Base.json").read_text())
    assert (base.eos_token_id, base.max_position_embeddings) == (base_ref["eos_token_id"],
                                                                 base_ref["max_position_embeddings"])
    for field in ARCH_FIELDS:
        if field not in ("eos_token_id", "max_position_embeddings"):
            assert getattr(base, field) == getattr(inst, field), field


@pytest.mark.parametrize("name,billions", [("Qwen3-0.6B", "0.596"), ("Qwen3-1.7B", "1.721"),
                                           ("Qwen3-8B", "8.191"), ("Qwen3-14B", "14.768"),
                                           ("Qwen3-8B-Base", "8.191"), ("Qwen3-0.6B-Base", "0.596")])
def test_param_count_equals_hf(name, billions):
    cfg = preset(name)
    hf_cfg = transformers.Qwen3Config(**cfg.to_hf_dict())
    with torch.device("meta"):
        hf_model = transformers.Qwen3ForCausalLM(hf_cfg)
    hf_count = sum(p.numel() for p in hf_model.parameters())   # tied weights are counted once
    ours = param_count(cfg)                                    # nnx.eval_shape: nothing allocated
    assert ours == hf_count
    assert f"{ours / 1e9:.3f}" == billions


def test_names_are_case_insensitive_and_accept_hub_ids():
    assert preset("qwen3-8b-base") == preset("Qwen3-8B-Base") == preset("Qwen/Qwen3-8B-Base")
    assert preset("Qwen3-14B", dtype="bfloat16").dtype == "bfloat16"
    assert set(PRESET_NAMES) == {f"Qwen3-{s}{b}" for s in ("0.6B", "1.7B", "8B", "14B") for b in ("", "-Base")}


def test_unknown_preset_and_missing_file_raise_clear_errors(tmp_path):
    with pytest.raises(KeyError, match="Qwen3-0.6B"):   # lists the known names
        preset("Qwen3-4B")
    with pytest.raises(FileNotFoundError, match="Qwen3-0.6B-Base.json"):
        from_hf_config("Qwen3-0.6B-Base", config_dir=tmp_path)
    bad = tmp_path / "llama.json"
    bad.write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="llama"):
        from_hf_config(bad)
    assert isinstance(preset("Qwen3-0.6B"), Qwen3Config)
