"""The policy's per-token log-probabilities and entropies for packed prompt+response batches.

One definition for every consumer (old log-probs, the S2T pre-pass, the gradient pass, SFT): the model's
hidden states go through the chunked LM-head path of ``stapo_jax.algo.logprobs`` (full vocabulary,
temperature-scaled, f32), so no ``[B, T, V]`` logits exist. Padded batches: the ``[B, R, D]`` hidden states at
the positions that predict the response tokens. Packed batches (``stapo_jax.train.packing``, verl's rmpad
log-prob path): the head runs on every packed position ``[M, L, D]`` against the next packed token, and only
the resulting scalars are gathered back to ``[B, R]``, so the head's work and activations follow the packed
tokens, not the response slots; when the ``[B, R]`` response columns are fewer than the ``M x L`` packed
positions (prompts long against responses), the hidden states at the response positions are gathered first and
the head runs on those only (HF ``logits_to_keep``), so it never does more than the smaller of the two.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax

from stapo_jax.algo.chunked_logprobs import chunked_log_probs_and_entropy
from stapo_jax.core.settings import check_one_of
from stapo_jax.train.packing import PackedLayout, gather_response_values


def response_log_probs_and_entropy(model, input_ids: jax.Array, attention_mask: jax.Array, response_length: int,
                                   *, temperature: float = 1.0, seq_chunk: int = 512,
                                   vocab_chunk: Optional[int] = None, packing: Optional[PackedLayout] = None,
                                   packing_shards: Optional[int] = None,
                                   lm_head_positions: str = "auto",
                                   calculate_entropy: bool = True) -> tuple[jax.Array, Optional[jax.Array]]:
    """Log-prob and entropy of each response token under ``model`` (see ``stapo_jax.train.batching`` for the layout).

    Args:
      model: a ``models.qwen3.Qwen3`` (call inside ``jit`` via ``nnx.merge`` for speed).
      input_ids: [B, P+R] int32, left-padded prompt then right-padded response.
      attention_mask: [B, P+R] bool.
      response_length: R (static), the number of response columns.
      temperature: logits are divided by it (the sampler's temperature).
      seq_chunk, vocab_chunk: chunk sizes of the LM-head pass (tokens, vocabulary entries).
      packing: optional :class:`stapo_jax.train.packing.PackedLayout` of this batch (``pack_sequences`` with
        ``num_shards=packing_shards``; default: the layout's ``num_shards``): the transformer runs on the
        packed rows (no padding; segment ids, per-sequence positions), the LM head on every packed position
        (targets: the next packed token, ``PackedLayout.next_token_ids``), and the per-token log-probs and
        entropies are gathered back into the [B, R] layout (``gather_response_values``); when B * R < M * L
        the hidden states and targets are gathered to [B, R] first and the head runs there. Either way the
        outputs equal the padded computation's on every response token; ``input_ids`` / ``attention_mask``
        only give the shapes.
      lm_head_positions: where a packed batch runs the LM head: "packed" (every packed position), "response"
        (the [B, R] response positions) or "auto" (the fewer of the two; same values either way).
      calculate_entropy: False skips the entropy pass (verl ``calculate_entropy``; SFT and losses without an
        entropy term); entropy is then None.
    Returns:
      (log_probs, entropy): [B, R] float32 each, in nats (entropy None without ``calculate_entropy``); padding
      columns hold finite values that callers mask.
    Raises:
      ValueError: ``response_length`` not in [1, T-1]; ConfigError (a ValueError): ``lm_head_positions`` not
        one of the three.
    """
    check_one_of("lm_head_positions", lm_head_positions, ("auto", "packed", "response"))
    t = input_ids.shape[1]
    if not 1 <= response_length < t:
        raise ValueError(f"response_length={response_length} must be in [1, {t - 1}] for sequences of {t} tokens")
    p = t - response_length
    w, layout = model.lm_head_weight_and_layout()
    head = functools.partial(chunked_log_probs_and_entropy, temperature=temperature, seq_chunk=seq_chunk,
                             vocab_chunk=vocab_chunk, weight_layout=layout, calculate_entropy=calculate_entropy)
    if packing is None:
        hidden, _ = model(input_ids, attention_mask)
        return head(hidden[:, p - 1:t - 1], w, input_ids[:, p:])
    hidden, _ = model(packing.input_ids, packing.attention_mask, positions=packing.positions,
                      segment_ids=packing.segment_ids)
    shards = packing.num_shards if packing_shards is None else packing_shards
    m, l = packing.input_ids.shape
    b, r = packing.response_index.shape
    if lm_head_positions == "response" or (lm_head_positions == "auto" and b * r < m * l):
        # fewer response columns than packed positions (short responses beside long prompts): the head runs on
        # the [B, R] positions that predict response tokens only (as HF's ``logits_to_keep``); padding columns
        # read position 0 of their block and get a zero cotangent from the masked loss
        pick = functools.partial(gather_response_values, response_index=packing.response_index, num_shards=shards)
        return head(pick(hidden), w, pick(packing.next_token_ids))
    # [M, L] per packed position; positions no response column reads (prompt, padding) hold finite values
    # (attention outputs at padding are finite) and get a zero cotangent from the gather
    lp, ent = head(hidden, w, packing.next_token_ids)
    return (gather_response_values(lp, packing.response_index, shards),
            None if ent is None else gather_response_values(ent, packing.response_index, shards))
