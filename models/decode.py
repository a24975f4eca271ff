"""Jitted prefill / one-token decode over the Qwen3 KV cache, and a greedy generator built on them.

These are the hot steps the rollout engine and the demo share. They take the model split as
``(graphdef, state)`` (``nnx.split``) so that parameters are ordinary pytree arguments: new weights of the same
shapes and shardings reuse the compiled functions.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.qwen3 import KVCache, Qwen3, init_cache


def last_valid_index(attention_mask: jax.Array) -> jax.Array:
    """Index of the last real token per row: [B] int32 from a [B, T] mask (0 for an all-padding row)."""
    m = attention_mask.astype(bool)
    t = m.shape[-1]
    return (t - 1 - jnp.argmax(m[:, ::-1], axis=-1)).astype(jnp.int32)


@partial(jax.jit, static_argnums=0)
def prefill(graphdef, state, input_ids: jax.Array, attention_mask: jax.Array, cache: KVCache):
    """Write a prompt batch into ``cache`` and return the logits that predict each row's next token.

    Args:
      graphdef, state: ``nnx.split(model)``.
      input_ids: [B, T] int32 prompts, left- or right-padded.
      attention_mask: [B, T], 1 on real prompt tokens.
      cache: a :class:`KVCache` with B rows (normally fresh from ``init_cache``).
    Returns:
      logits [B, V] float32 at each row's last real token; the updated cache.
    """
    model = nnx.merge(graphdef, state)
    hidden, cache = model(input_ids, attention_mask, cache=cache)
    idx = last_valid_index(attention_mask)
    last = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
    return model.logits(last), cache


@partial(jax.jit, static_argnums=0)
def decode_step(graphdef, state, tokens: jax.Array, cache: KVCache, active: jax.Array | None = None):
    """Feed one token per row and return the next-token logits.

    Args:
      tokens: [B] int32, the token each row appends.
      cache: :class:`KVCache` with B rows.
      active: optional [B] bool; inactive rows write a masked (invisible) key and keep their position.
    Returns:
      logits [B, V] float32; the updated cache.
    """
    model = nnx.merge(graphdef, state)
    mask = jnp.ones(tokens.shape, bool) if active is None else active.astype(bool)
    hidden, cache = model(tokens[:, None], mask[:, None], cache=cache)
    return model.logits(hidden[:, 0]), cache


def greedy_generate(model: Qwen3, input_ids, attention_mask, max_new_tokens: int,
                    eos_token_ids: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Greedy (argmax) continuation of a prompt batch, stopping each row at its first EOS.

    Args:
      model: a :class:`Qwen3`.
      input_ids: [B, T] int prompts; attention_mask: [B, T] (1 on real tokens).
      max_new_tokens: tokens to generate per row (> 0).
      eos_token_ids: ids that end a row; the EOS token itself is included in the output.
    Returns:
      tokens [B, max_new_tokens] int32 (positions after a row's end hold the EOS id repeated, or are 0 when
      there is no EOS id) and lengths [B] int32 (tokens generated per row, EOS included).
    Raises:
      ValueError: ``max_new_tokens`` <= 0 or prompt/mask shape mismatch.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be > 0")
    input_ids = jnp.asarray(input_ids, jnp.int32)
    attention_mask = jnp.asarray(attention_mask, bool)
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be equal [B, T]")
    graphdef, state = nnx.split(model)
    b, t = input_ids.shape
    cache = init_cache(model.config, b, t + max_new_tokens)
    logits, cache = prefill(graphdef, state, input_ids, attention_mask, cache)
    eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
    done = jnp.zeros((b,), bool)
    lengths = np.zeros((b,), np.int32)
    out = []
    for step in range(max_new_tokens):
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tok = jnp.where(done, out[-1] if out else tok, tok)
        out.append(tok)
        lengths += np.asarray(~done, np.int32)
        done = done | jnp.isin(tok, eos)
        if step + 1 < max_new_tokens and not bool(done.all()):
            logits, cache = decode_step(graphdef, state, tok, cache, ~done)
        elif step + 1 < max_new_tokens:
            out.extend([tok] * (max_new_tokens - step - 1))
            break
    return np.asarray(jnp.stack(out, axis=1)), lengths
