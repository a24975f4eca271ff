"""The explicit KV cache of cached decoding: :class:`KVCache` (one ``[B, num_key_value_heads, S, head_dim]`` buffer
per layer, so a decode step writes the new token in place), :func:`init_cache`, the per-row cache write
(:func:`write_rows`) and grouped-query attention over the cache (:func:`cached_attention`).
See :mod:`models.qwen3` for why the cache is per layer.
"""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from models.platform import mesh_platform
from models.qwen3_config import Qwen3Config

__all__ = ["KVCache", "init_cache", "write_rows", "cached_attention"]


@flax.struct.dataclass
class KVCache:
    """Per-layer keys/values for prefill + one-token decode, usable with independent slots (rows).

    Fields:
      k, v: tuples of L arrays (one per layer, separate buffers so a decode step updates each in place),
        each [B, num_key_value_heads, S, head_dim] in the cache dtype. S = max cache length (tokens).
      key_mask: [B, S] bool, True where the cache holds a real (non-padding) key.
      length: [B] int32, next cache index each row writes to.
      next_position: [B] int32, RoPE position of each row's next real token.
    """

    k: tuple
    v: tuple
    key_mask: jax.Array
    length: jax.Array
    next_position: jax.Array

    @property
    def max_length(self) -> int:
        """S, the cache length in tokens (axis 2 of each ``k`` buffer)."""
        return self.k[0].shape[2]

    @property
    def batch_size(self) -> int:
        """B, the number of rows (slots) in the cache."""
        return self.k[0].shape[0]


def init_cache(config: Qwen3Config, batch_size: int, max_length: int, dtype=None) -> KVCache:
    """An empty cache of ``batch_size`` rows and ``max_length`` token slots (zeros; nothing valid).

    Layout: see :class:`KVCache` (L arrays [B, num_key_value_heads, S, head_dim] for keys and for values).
    Memory: 2 · L · B · S · num_key_value_heads · head_dim · itemsize bytes.
    Raises:
      ValueError: non-positive ``batch_size`` or ``max_length``.

    Dtypes: keys / values in ``dtype`` (default ``config.dtype``, e.g. bfloat16 / float32), ``key_mask`` bool,
    ``length`` / ``next_position`` int32. Source: HF transformers ``StaticCache`` (preallocated KV slots).
    """
    if batch_size <= 0 or max_length <= 0:
        raise ValueError(f"init_cache: batch_size={batch_size} and max_length={max_length} must be positive")
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (batch_size, config.num_key_value_heads, max_length, config.head_dim)
    n = config.num_hidden_layers
    return KVCache(
        k=tuple(jnp.zeros(shape, dtype) for _ in range(n)), v=tuple(jnp.zeros(shape, dtype) for _ in range(n)),
        key_mask=jnp.zeros((batch_size, max_length), bool),
        length=jnp.zeros((batch_size,), jnp.int32), next_position=jnp.zeros((batch_size,), jnp.int32))


def write_rows(cache: jax.Array, update: jax.Array, index: jax.Array) -> jax.Array:
    """``cache[b, :, index[b]:index[b] + T] = update[b]`` for every row, in place when ``cache`` is donated.

    Args: cache ``[B, Nkv, S, H]`` (any float dtype); update ``[B, Nkv, T, H]`` (cast to the cache dtype);
    index ``[B]`` int32 write positions (clamped by ``dynamic_update_slice`` so the T tokens fit).
    Returns the updated cache (same shape and dtype).

    One batched (vmapped) dynamic-update-slice, except for a 16-bit cache on XLA:CPU (no in-place 16-bit update:
    it would convert the whole cache to float32 and back every step): rows written one by one in a ``fori_loop``.
    TPU/GPU (the active mesh's platform, ``models.platform``) take the batched form.

    Never raises (traced). Source: HF transformers ``StaticCache.update`` (per-row write at the cache position).
    """
    update = update.astype(cache.dtype)
    if jnp.dtype(cache.dtype).itemsize == 2 and mesh_platform() == "cpu":
        def row(r, c):
            return jax.lax.dynamic_update_slice(c, jax.lax.dynamic_slice_in_dim(update, r, 1, 0), (r, 0, index[r], 0))

        return jax.lax.fori_loop(0, cache.shape[0], row, cache)
    return jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=1))(cache, update, index)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """Grouped-query attention of T queries over a head-major KV cache.

    Logits in float32, scaled after the dot and masked with ``-0.7 * finfo.max`` (as
    ``jax.nn.dot_product_attention(implementation="xla")``); ``exp(logits - max)`` multiplies the values *before*
    it is normalised (``out = (p @ v) / sum(p)``, FlashAttention's order: the division runs on the [T, H] output,
    not on the [S, T] probabilities), over the cache's ``[B, Nkv, S, H]`` layout, whose batch dims (B, Nkv) lead:
    XLA runs both matmuls on the buffers as they are, without transposing the cache.

    Args:
      q: [B, T, N, H] queries (N = Nkv · G).
      k, v: [B, Nkv, S, H] cache of this layer (cast to q's dtype; a no-op when they agree).
      mask: [B, 1, T, S] bool, True where query t may attend key s.
      scale: logit scale (``head_dim ** -0.5``).
    Returns:
      [B, T, N, H] in q's dtype (query head n uses KV head ``n // G``, as HF ``repeat_kv``).

    Never raises (traced; mismatched shapes fail at trace time). Source: ``jax.nn.dot_product_attention``
    (XLA implementation), HF ``repeat_kv`` grouped-query attention, FlashAttention's (Dao et al. 2022) late
    normalisation.
    """
    b, t, n, h = q.shape
    nkv, s = k.shape[1], k.shape[2]
    g = n // nkv
    qg = q.reshape(b, t, nkv, g, h).transpose(0, 2, 1, 3, 4).reshape(b, nkv, t * g, h)
    # keys as the left operand ([S, H] x [H, T*G] per batch: a row-major matrix times a few columns, no
    # transposed operand) and logits laid out [B, Nkv, S, T*G], which XLA:CPU runs faster than [B, Nkv, T*G, S]
    # at decode shapes (T*G = 2, S = 144; bench/bench_rollout.py times the whole decode); the same sums.
    logits = jnp.einsum("bksh,bkqh->bksq", k.astype(q.dtype), qg, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(scale)
    m = jnp.broadcast_to(mask[:, :, :, None, :], (b, 1, t, g, s)).reshape(b, 1, t * g, s)
    logits = jnp.where(jnp.swapaxes(m, -1, -2), logits, jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max)))
    p = jnp.exp(logits - jnp.max(logits, axis=-2, keepdims=True))
    denom = jnp.sum(p, axis=-2)[..., None]  # [B, Nkv, T*G, 1]
    acc = jnp.einsum("bksq,bksh->bkqh", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    out = (acc / denom).astype(q.dtype)
    return out.reshape(b, nkv, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
