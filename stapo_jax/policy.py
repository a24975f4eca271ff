"""The policy's per-token log-probabilities and entropies for packed prompt+response batches.

One definition for every consumer (old log-probs, the S2T pre-pass, the gradient pass, SFT): the model's
hidden states at the positions that predict the response tokens go through the chunked LM-head path of
``stapo_jax.logprobs`` (full vocabulary, temperature-scaled, f32), so no ``[B, T, V]`` logits exist.
"""
from __future__ import annotations

from typing import Optional

import jax

from stapo_jax.logprobs import chunked_log_probs_and_entropy


def response_log_probs_and_entropy(model, input_ids: jax.Array, attention_mask: jax.Array, response_length: int,
                                   *, temperature: float = 1.0, seq_chunk: int = 512,
                                   vocab_chunk: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
    """Log-prob and entropy of each response token under ``model`` (see ``stapo_jax.batching`` for the layout).

    Args:
      model: a ``models.qwen3.Qwen3`` (call inside ``jit`` via ``nnx.merge`` for speed).
      input_ids: [B, P+R] int32, left-padded prompt then right-padded response.
      attention_mask: [B, P+R] bool.
      response_length: R (static), the number of response columns.
      temperature: logits are divided by it (the sampler's temperature).
      seq_chunk, vocab_chunk: chunk sizes of the LM-head pass (tokens, vocabulary entries).
    Returns:
      (log_probs, entropy): [B, R] float32 each, in nats; padding columns hold finite values that callers mask.
    Raises:
      ValueError: ``response_length`` not in [1, T-1].
    """
    t = input_ids.shape[1]
    if not 1 <= response_length < t:
        raise ValueError(f"response_length={response_length} must be in [1, {t - 1}] for sequences of {t} tokens")
    hidden, _ = model(input_ids, attention_mask)
    p = t - response_length
    h = hidden[:, p - 1:t - 1]
    targets = input_ids[:, p:]
    return chunked_log_probs_and_entropy(h, model.lm_head_weight(), targets, temperature=temperature,
                                         seq_chunk=seq_chunk, vocab_chunk=vocab_chunk)
