"""The building blocks of the Qwen3 decoder (HF ``Qwen3ForCausalLM``, conventions.md §6): positions from the mask,
rotate-half RoPE, RMSNorm, grouped-query attention with per-head ``q_norm`` / ``k_norm``, the SwiGLU MLP, one decoder
layer, and the per-layer rematerialisation wrapper. :mod:`models.qwen3` stacks the layers into the model.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import dot_product_attention
from models.kv_cache import cached_attention, write_rows
from models.linear import Linear
from models.qwen3_config import REMAT_POLICIES, Qwen3Config
from models.sharding import constrain

__all__ = ["remat_layer", "positions_from_mask", "rope_cos_sin", "apply_rope", "RMSNorm", "make_linear", "Attention",
           "MLP", "DecoderLayer"]


def remat_layer(fn, remat: str):
    """``fn`` (one decoder layer's step, any signature) wrapped in the ``jax.checkpoint`` policy named ``remat``
    (``Qwen3Config.remat``: ``none`` returns ``fn`` itself, ``full`` saves nothing, ``dots`` saves every matmul
    output, ``dots_no_batch`` the matmul outputs without batch dimensions). It wraps ``fn`` only; raises
    KeyError naming the value for an unknown policy. Source: ``jax.checkpoint_policies`` (MaxText's
    ``remat_policy`` names the same choices)."""
    if remat not in REMAT_POLICIES:
        raise KeyError(f"remat={remat!r}: expected one of {sorted(REMAT_POLICIES)}")
    policy = REMAT_POLICIES[remat]
    if policy == "full":
        return jax.checkpoint(fn)
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """``max(cumsum(mask) - 1, 0)`` along the last axis: [B, T] int32 (verl ``compute_position_id_with_mask``).
    Never raises (traced)."""
    m = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """Rotate-half RoPE tables: cos, sin of shape [B, T, head_dim] in float32 (HF ``Qwen3RotaryEmbedding``).
    Never raises (traced). Source: RoFormer (Su et al. 2021) as HF transformers implements it."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [B, T, N, H]; cos/sin: [B, T, H]. Cast to x's dtype first, as HF does.
    Returns [B, T, N, H] in x's dtype; never raises (traced). Source: HF ``apply_rotary_pos_emb``."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + _rotate_half(x) * sin


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a ``weight`` parameter [dim] (HF ``Qwen3RMSNorm`` cast order)."""

    def __init__(self, dim: int, eps: float, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x):
        dtype = x.dtype
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(dtype) * y.astype(dtype)


def make_linear(cfg: Qwen3Config, din: int, dout: int, rngs: nnx.Rngs) -> Linear:
    """A bias-free :class:`~models.linear.Linear` ``[din] -> [dout]`` in ``cfg``'s compute dtype, its kernel
    ``[din, dout]`` in ``cfg``'s parameter dtype drawn from ``normal(cfg.initializer_range)``. Never raises.
    Source: HF ``Qwen3`` (``nn.Linear(bias=False)``, ``_init_weights``' normal initialiser)."""
    return Linear(din, dout, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                  kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query attention with per-head q_norm/k_norm before RoPE."""

    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.head_dim
        self.q_proj = make_linear(cfg, cfg.hidden_size, cfg.num_attention_heads * h, rngs)
        self.k_proj = make_linear(cfg, cfg.hidden_size, cfg.num_key_value_heads * h, rngs)
        self.v_proj = make_linear(cfg, cfg.hidden_size, cfg.num_key_value_heads * h, rngs)
        self.o_proj = make_linear(cfg, cfg.num_attention_heads * h, cfg.hidden_size, rngs)
        self.q_norm = RMSNorm(h, cfg.rms_norm_eps, cfg.weight_dtype)
        self.k_norm = RMSNorm(h, cfg.rms_norm_eps, cfg.weight_dtype)

    def __call__(self, x, cos, sin, mask, kv=None, write_index=None, segment_ids=None):
        """x [B,T,D]; kv: (k, v) cache buffers [B,Nkv,S,H] of this layer or None; write_index [B].

        With ``segment_ids`` ([B,T] int32, 0 = padding) the T tokens attend to each other with the configured
        kernel (:func:`models.attention.dot_product_attention`; the uncached forward and prefill into an
        empty cache); otherwise they attend over the cache with ``mask`` [B,1,T,S] bool (decode).
        """
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, cfg.num_attention_heads, cfg.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim))
        v = self.v_proj(x).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        q = constrain(apply_rope(q, cos, sin), ("batch", None, "heads", None))
        k = apply_rope(k, cos, sin)
        if segment_ids is not None:
            out = dot_product_attention(q, k, v, segment_ids, implementation=cfg.attention,
                                        scale=cfg.head_dim ** -0.5, block_size=cfg.attention_block_size)
            if kv is None:
                return self.o_proj(out.reshape(b, t, cfg.num_attention_heads * cfg.head_dim)), None
        # cache layout [B, Nkv, S, H]: write the T new keys/values of each row at its write index (in place)
        ck = write_rows(kv[0], jnp.swapaxes(k, 1, 2), write_index)
        cv = write_rows(kv[1], jnp.swapaxes(v, 1, 2), write_index)
        if segment_ids is None:
            out = cached_attention(q, ck, cv, mask, cfg.head_dim ** -0.5)
        return self.o_proj(out.reshape(b, t, cfg.num_attention_heads * cfg.head_dim)), (ck, cv)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.gate_proj = make_linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.up_proj = make_linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.down_proj = make_linear(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)

    def __call__(self, x):
        h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(constrain(h, ("batch", None, "mlp")))


class DecoderLayer(nnx.Module):
    """One Qwen3 block (HF ``Qwen3DecoderLayer``): ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``__call__(x [B,T,D], cos, sin, mask, kv, write_index, segment_ids)`` -> ``(x [B,T,D], new_kv)``; the
    arguments are :class:`Attention`'s (``new_kv`` is this layer's updated cache buffers, or None uncached).
    """

    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype)
        self.self_attn = Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.weight_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, mask, kv=None, write_index=None, segment_ids=None):
        a, new_kv = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, write_index, segment_ids)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x))
        return constrain(x, ("batch", None, None)), new_kv
