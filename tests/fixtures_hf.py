"""Tiny random HF Qwen3 checkpoints (transformers' PyTorch ``Qwen3ForCausalLM``, ``save_pretrained``) and the
HF-side reference computations used by the parity tests. Import the fixtures where needed.

Weights are re-drawn after HF's init (std 0.02 would make every logit ~0 and hide mapping bugs): projections
~N(0, 0.15²), embeddings ~N(0, 0.5²), every RMSNorm weight 1 + N(0, 0.2²) so a swapped q_norm/k_norm or
input/post-attention norm changes the output.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

torch.set_default_dtype(torch.float32)

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10000.0,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_hf_model(tied: bool, seed: int = 0, **overrides) -> transformers.Qwen3ForCausalLM:
    """A float32, eval-mode ``Qwen3ForCausalLM`` with :data:`TINY` sizes (``overrides`` replace fields)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{**TINY, **overrides}, tie_word_embeddings=tied)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
    return model


def padded_batch(seed: int = 1, vocab_size: int = TINY["vocab_size"], t: int = 12):
    """ids [4, t] int64, mask [4, t] int64: a full row, two left-padded rows of ragged lengths, and one row
    padded on both sides (left-padded prompt + right-padded response)."""
    g = np.random.default_rng(seed)
    ids = g.integers(3, vocab_size, size=(4, t))
    mask = np.ones((4, t), np.int64)
    mask[1, :3] = 0
    mask[2, :7] = 0
    mask[3, :2] = 0
    mask[3, -4:] = 0
    ids = np.where(mask == 1, ids, 0)   # pad id 0
    return ids.astype(np.int64), mask


def positions_from_mask(mask: np.ndarray) -> np.ndarray:
    """verl ``compute_position_id_with_mask``: max(cumsum(mask) - 1, 0)."""
    return np.maximum(np.cumsum(mask, -1) - 1, 0)


def hf_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits [B, T, V] float32 with mask-derived position ids (as HF ``generate`` uses)."""
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                    position_ids=torch.as_tensor(positions_from_mask(mask)))
    return out.logits.float().numpy()


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory):
    """(HF model, checkpoint dir): tied head, one ``model.safetensors``."""
    model = make_hf_model(tied=True, seed=0)
    path = tmp_path_factory.mktemp("hf_tied")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="session")
def hf_untied_sharded(tmp_path_factory):
    """(HF model, checkpoint dir): untied head, saved in several shards with ``model.safetensors.index.json``."""
    model = make_hf_model(tied=False, seed=1)
    path = tmp_path_factory.mktemp("hf_untied_sharded")
    model.save_pretrained(path, max_shard_size="60KB")
    return model, path
