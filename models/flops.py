"""Analytic matmul FLOPs of the Qwen3 port (one definition, used by ``stapo-jax plan`` and the trainer's MFU):
a decoder layer's matmul weights, one forward over a sequence, one decoded token.
"""
from __future__ import annotations

__all__ = ["layer_matmul_params", "sequence_forward_flops", "decode_token_flops"]


def layer_matmul_params(qcfg) -> int:
    """Weights of one decoder layer's matmuls: q/o (D x Nh x H each), k/v (D x Nkv x H each), the SwiGLU gate/up/
    down (D x F each). ``qcfg``: a Qwen3 config (``hidden_size`` ...). Returns an int; raises AttributeError for a
    config without those fields. Source: Qwen3's layer (HF ``Qwen3DecoderLayer``)."""
    d, f = qcfg.hidden_size, qcfg.intermediate_size
    return d * qcfg.num_attention_heads * qcfg.head_dim * 2 + d * qcfg.num_key_value_heads * qcfg.head_dim * 2 \
        + 3 * d * f


def sequence_forward_flops(qcfg, tokens, response_tokens):
    """Matmul FLOPs of one forward over a sequence of ``tokens`` positions whose last ``response_tokens`` go
    through the LM head: 2 x (layer matmul params x T) x L + 4 x L x T^2 x Nh x H (attention over the full T x T
    score matrix, as the XLA kernel computes it) + 2 x D x V x R. ``tokens`` / ``response_tokens``: ints or
    numpy arrays of them (elementwise; float64 out for arrays). Raises AttributeError for a config without the
    Qwen3 size fields. Source: Kaplan et al. 2020 (forward = 2 x params x tokens)."""
    layers, t, r = qcfg.num_hidden_layers, tokens, response_tokens
    return 2 * layers * layer_matmul_params(qcfg) * t \
        + 4 * layers * t * t * qcfg.num_attention_heads * qcfg.head_dim + 2 * qcfg.hidden_size * qcfg.vocab_size * r


def decode_token_flops(qcfg, context: int) -> int:
    """Matmul FLOPs of decoding one token against ``context`` cached positions: 2 x (L x layer matmul params +
    D x V) + 4 x L x context x Nh x H. Ints in and out; raises AttributeError for a config without the Qwen3
    size fields. Source: Kaplan et al. 2020 (2 x params per token), plus attention over the cache."""
    layers = qcfg.num_hidden_layers
    return 2 * (layers * layer_matmul_params(qcfg) + qcfg.hidden_size * qcfg.vocab_size) \
        + 4 * layers * context * qcfg.num_attention_heads * qcfg.head_dim
