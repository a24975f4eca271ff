"""Shared helpers of the rollout tests: a tiny Qwen3, its transformers twin (same weights through the
models/hf.py exporter), and HF greedy generation as the reference."""
from __future__ import annotations

import functools
import tempfile

import numpy as np
import torch
from flax import nnx

from models.hf import save_hf_checkpoint
from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.assets import qwen3_tokenizer_dir
from stapo_jax.rollout.engine import EngineConfig, Qwen3Engine
from stapo_jax.rollout.sampling import SamplingParams

TOKENIZER_DIR = str(qwen3_tokenizer_dir())


def tiny_config(**kw) -> Qwen3Config:
    """2 layers, D=32, GQA 4/2 heads of 8, V=128; large init so greedy choices have clear margins.
    No EOS id in the config (Qwen3's 151643/151645 lie outside the vocabulary), so only an explicit
    ``eos_token_ids`` stops a row."""
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=None,
                bos_token_id=None, pad_token_id=0, initializer_range=0.5, tie_word_embeddings=False)
    base.update(kw)
    return Qwen3Config(**base)


def tiny_model(seed: int = 0, **kw) -> Qwen3:
    return Qwen3(tiny_config(**kw), rngs=nnx.Rngs(seed))


@functools.lru_cache(maxsize=4)
def _hf_twin_cached(seed: int):
    from transformers import Qwen3ForCausalLM

    model = tiny_model(seed)
    with tempfile.TemporaryDirectory() as d:
        save_hf_checkpoint(model, model.config, d)
        hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return model, hf


def model_and_hf_twin(seed: int = 0):
    """(our tiny model, transformers Qwen3ForCausalLM with the same weights), cached per seed."""
    return _hf_twin_cached(seed)


def hf_greedy(hf, prompt, max_new_tokens: int, eos_token_ids=None) -> list[int]:
    """HF ``generate`` (greedy, KV cache) for one unpadded prompt; returns the new ids (EOS included)."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=eos_token_ids, pad_token_id=0, use_cache=True,
                          top_k=None, top_p=None, temperature=None)
    new = out[0, ids.shape[1]:].tolist()
    if eos_token_ids:  # HF pads finished rows only in batches; a single row simply stops
        for k, t in enumerate(new):
            if t in eos_token_ids:
                return new[: k + 1]
    return new


def make_engine(model=None, *, slots=4, max_prefill_length=32, max_decode_length=16,
                sampling=SamplingParams(greedy=True), eos_token_ids=None, mesh=None, tokenizer=None):
    model = model if model is not None else tiny_model(0)
    cfg = EngineConfig(max_concurrent_decodes=slots, max_prefill_length=max_prefill_length,
                       max_decode_length=max_decode_length, sampling=sampling, eos_token_ids=eos_token_ids)
    return Qwen3Engine(model, cfg, mesh=mesh, tokenizer=tokenizer)


RAGGED_PROMPTS = [[3, 17, 99, 4], [8], [42, 7, 7, 120, 5, 9, 61, 2, 33, 90, 11], [100, 1, 64]]


def rows_of(batch, row: int) -> list[int]:
    return batch.responses[row, : batch.response_lengths[row]].tolist()


def as_list(a) -> list[int]:
    return np.asarray(a).tolist()

PROMPTS_SHARDED = RAGGED_PROMPTS + [[9, 9, 9, 9, 9, 9], [127, 0, 64, 32, 16]]
