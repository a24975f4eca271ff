"""Packing token lists into the fixed-shape arrays every jitted step takes (verl's layout).

A sequence is ``[left-padded prompt | right-padded response]``: ``input_ids`` [B, P + R]. Response-level
arrays (``response_mask``, ``log_probs``, ``old_log_probs``, ``advantages`` per token) are [B, R], where
column ``r`` is the response token at ``input_ids[:, P + r]``, predicted by the hidden state at ``P + r - 1``.
Lengths are rounded up to a multiple of ``pad_multiple`` so that steps recompile only when a bucket changes.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= max(n, 1).
    Takes and returns a Python int. Never raises (``multiple`` >= 1 assumed). Source: verl's padding
    of P / R to a multiple (conventions.md §6)."""
    return max(1, -(-max(n, 1) // multiple)) * multiple


def pack_prompt_response(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int,
                         prompt_length: Optional[int] = None, response_length: Optional[int] = None,
                         pad_multiple: int = 8, vocab_size: Optional[int] = None) -> dict[str, np.ndarray]:
    """Left-pad prompts and right-pad responses into one batch.

    Args:
      prompts: B token-id lists (non-empty).
      responses: B token-id lists (may be empty: such a row has no response token).
      pad_id: id written into padding (masks, never ids, mark padding: Qwen3's pad id equals the base EOS).
      prompt_length, response_length: fixed P and R; default: the longest, rounded up to ``pad_multiple``.
      vocab_size: when given, every id must be < ``vocab_size`` (an id past the embedding table would be
        clamped or read garbage by the jitted gather instead of failing).
    Returns:
      ``input_ids`` [B, P+R] int32, ``attention_mask`` [B, P+R] bool, ``response_mask`` [B, R] bool,
      ``prompt_lengths`` [B] int32, ``response_lengths`` [B] int32 (tokens).
    Raises:
      ValueError: different numbers of prompts and responses, an empty prompt (names its index), a sequence
        longer than the fixed ``prompt_length``/``response_length`` (no silent truncation), or a token id that
        is negative or >= ``vocab_size`` (names the prompt/response index, position and id).
    Source: verl's ``input_ids`` / ``attention_mask`` / ``response_mask`` layout (conventions.md §6).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not len(prompts):
        raise ValueError("empty batch: no prompts")
    pl = np.asarray([len(p) for p in prompts], np.int32)
    rl = np.asarray([len(r) for r in responses], np.int32)
    if (pl == 0).any():
        raise ValueError(f"prompt {int(np.argmin(pl))} is empty")
    if pad_multiple < 1 or (prompt_length is not None and prompt_length < 1) or \
            (response_length is not None and response_length < 1) or (vocab_size is not None and vocab_size < 1):
        raise ValueError(f"prompt_length={prompt_length}, response_length={response_length}, "
                         f"pad_multiple={pad_multiple} and vocab_size={vocab_size} must be >= 1")
    P = prompt_length if prompt_length is not None else round_up(int(pl.max()), pad_multiple)
    R = response_length if response_length is not None else round_up(int(rl.max()), pad_multiple)
    if pl.max() > P:
        i = int(np.argmax(pl))
        raise ValueError(f"prompt {i} has {pl[i]} tokens > prompt_length {P}")
    if rl.max() > R:
        i = int(np.argmax(rl))
        raise ValueError(f"response {i} has {rl[i]} tokens > response_length {R}")
    _check_token_ids(prompts, "prompt", vocab_size)
    _check_token_ids(responses, "response", vocab_size)
    b = len(prompts)
    ids = np.full((b, P + R), pad_id, np.int32)
    att = np.zeros((b, P + R), bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, P - len(p):P] = p
        att[i, P - len(p):P] = True
        ids[i, P:P + len(r)] = r
        att[i, P:P + len(r)] = True
    resp_mask = att[:, P:].copy()
    return {"input_ids": ids, "attention_mask": att, "response_mask": resp_mask,
            "prompt_lengths": pl, "response_lengths": rl}


def _check_token_ids(seqs: Sequence[Sequence[int]], what: str, vocab_size: Optional[int]) -> None:
    """Raise ValueError naming ``what`` {index} for the first id that is not an integer in
    ``[0, vocab_size)`` (``[0, 2**31)``, the int32 range of ``input_ids``, without ``vocab_size``)."""
    upper = vocab_size if vocab_size is not None else np.iinfo(np.int32).max + 1
    for i, seq in enumerate(seqs):
        a = np.asarray(seq)
        if not a.size:
            continue
        if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{what} {i} must be a flat list of integer token ids, got dtype {a.dtype} "
                             f"shape {a.shape}")
        bad = (a < 0) | (a >= upper)
        if bad.any():
            j = int(np.argmax(bad))
            bound = f"vocab_size={upper}" if vocab_size is not None else f"{upper} (int32 input_ids)"
            raise ValueError(f"{what} {i} has token id {int(a[j])} at position {j}, outside [0, {bound})")


def response_hidden_slice(prompt_length: int, response_length: int) -> slice:
    """Positions of the hidden states that predict the R response tokens: ``P-1 .. P+R-2``.
    Python ints -> a ``slice`` over the ``[B, P + R, D]`` hidden states (its length is R). Never raises. Source: the
    causal shift of verl's ``logits[:, -R - 1:-1]`` (conventions.md §6). Takes Python int P and R."""
    return slice(prompt_length - 1, prompt_length + response_length - 1)
