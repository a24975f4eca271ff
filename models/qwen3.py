"""Qwen3 decoder in Flax NNX: hidden states out, LM head as a separate method, explicit KV cache pytree.

Follows transformers' ``Qwen3ForCausalLM`` (conventions.md §6): pre-norm blocks, RMSNorm (eps from the
config; f32 normalisation, cast back to the input dtype, then multiplied by the weight, as HF does), GQA with
per-head ``q_norm``/``k_norm`` applied before RoPE (rotate-half, theta from the config), SwiGLU MLP, no biases,
tied or untied LM head. Layers are stacked on a leading axis and applied with ``jax.lax.scan`` so compile
time does not grow with depth; optional rematerialisation per layer.

Decoding with a :class:`KVCache` applies the layers in a Python loop instead (one compiled copy per layer):
each layer's keys/values are their own buffer, laid out ``[B, num_key_value_heads, S, head_dim]``, so the new
token is written in place and both attention matmuls read the cache directly. A scan over a stacked
``[L, ...]`` cache made XLA copy each layer's slice out, transpose it for the matmul and write it back on every
step (about 3 cache copies per token; see ``bench/bench_rollout.py``).

Padding is masked inside attention (key-valid and causal), and positions come from the mask
(``max(cumsum(mask) - 1, 0)``, Tunix ``build_positions_from_mask`` / verl ``compute_position_id_with_mask``),
so left-padded prompts and right-padded responses give the same per-token outputs as unpadded ones.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import DEFAULT_BLOCK, IMPLEMENTATIONS, dot_product_attention, segment_ids_from_mask
from models.linear import Linear, set_kernel_layout
from models.platform import mesh_platform
from models.sharding import constrain
from models.special_tokens import QWEN3_ENDOFTEXT_ID, QWEN3_IM_END_ID
from stapo_jax.core.errors import ConfigError

_REMAT_POLICIES = {
    "none": None,
    "full": "full",
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_layer(fn, remat: str):
    """``fn`` (one decoder layer's step, any signature) wrapped in the ``jax.checkpoint`` policy named ``remat``
    (``Qwen3Config.remat``: ``none`` returns ``fn`` itself, ``full`` saves nothing, ``dots`` saves every matmul
    output, ``dots_no_batch`` the matmul outputs without batch dimensions). It wraps ``fn`` only; raises
    KeyError naming the value for an unknown policy. Source: ``jax.checkpoint_policies`` (MaxText's
    ``remat_policy`` names the same choices)."""
    if remat not in _REMAT_POLICIES:
        raise KeyError(f"remat={remat!r}: expected one of {sorted(_REMAT_POLICIES)}")
    policy = _REMAT_POLICIES[remat]
    if policy == "full":
        return jax.checkpoint(fn)
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 architecture plus the dtype / remat policy of this port. Field names follow HF ``config.json``.

    ``dtype`` is the compute dtype (activations, matmul inputs), ``param_dtype`` the storage dtype of
    parameters; norms, softmax and logits are always computed in float32. ``remat`` is one of
    ``none | full | dots | dots_no_batch`` (``jax.checkpoint`` policy per layer); ``scan_unroll`` the layers per
    iteration of the layer scan (:mod:`models.layer_scan`; 1: a rolled loop). ``attention`` is the
    self-attention kernel of the uncached forward and of prefill (``xla | blockwise | cudnn | splash | auto``,
    see :mod:`models.attention`); cached decoding always attends over the KV cache. ``attention_block_size``
    is the blockwise/splash tile in tokens.
    """

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = QWEN3_ENDOFTEXT_ID
    eos_token_id: Any = QWEN3_IM_END_ID  # int or tuple of ints
    pad_token_id: Optional[int] = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    scan_unroll: int = 1
    attention: str = "xla"
    attention_block_size: int = DEFAULT_BLOCK

    def __post_init__(self):
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"Qwen3Config.{f}={getattr(self, f)!r}: expected float32, bfloat16 or float16")
        if self.attention not in IMPLEMENTATIONS:
            raise ConfigError(f"Qwen3Config.attention={self.attention!r}: expected one of {list(IMPLEMENTATIONS)}")
        if self.attention_block_size <= 0:
            raise ConfigError(f"Qwen3Config.attention_block_size={self.attention_block_size} must be positive")
        if self.remat not in _REMAT_POLICIES:
            raise ConfigError(f"Qwen3Config.remat={self.remat!r}: expected one of {sorted(_REMAT_POLICIES)}")
        if isinstance(self.scan_unroll, bool) or not isinstance(self.scan_unroll, int) or self.scan_unroll < 1:
            raise ConfigError(f"Qwen3Config.scan_unroll={self.scan_unroll!r}: expected an int >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All EOS ids as a tuple (HF allows an int or a list)."""
        e = self.eos_token_id
        if e is None:
            return ()
        return tuple(e) if isinstance(e, (tuple, list)) else (int(e),)

    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "Qwen3Config":
        """Build from an HF ``config.json`` dict (transformers 4.51 form or 5.x ``rope_parameters`` form).

        Raises:
          ConfigError: ``model_type``/``architectures`` is not Qwen3, RoPE scaling, attention bias or sliding
            window is requested, or a required field is missing.
        """
        mt = d.get("model_type")
        archs = d.get("architectures") or []
        if mt != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise ConfigError(f"not a Qwen3 config: model_type={mt!r}, architectures={archs!r} (expected 'qwen3')")
        rope = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope.get("rope_theta"))
        if theta is None:
            raise ConfigError("Qwen3 config has neither 'rope_theta' nor 'rope_parameters.rope_theta'")
        rope_type = rope.get("rope_type", "default")
        scaling = d.get("rope_scaling")
        if rope_type != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
            raise ConfigError(f"RoPE scaling is not supported: rope_parameters={rope!r}, rope_scaling={scaling!r}")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias=true is not Qwen3's architecture and is not supported")
        if d.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=true is not supported")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in d]
        if missing:
            raise ConfigError(f"Qwen3 config is missing {missing}")
        nh = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=nh,
            num_key_value_heads=d.get("num_key_value_heads") or nh,
            head_dim=d.get("head_dim") or d["hidden_size"] // nh,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=d.get("max_position_embeddings", 40960),
            initializer_range=d.get("initializer_range", 0.02),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_json(cls, path, **overrides) -> "Qwen3Config":
        """Read an HF ``config.json`` file (see :meth:`from_hf_dict`)."""
        with open(path) as f:
            return cls.from_hf_dict(json.load(f), **overrides)

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict that ``transformers.Qwen3ForCausalLM`` / ``Qwen3Config`` loads."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": None, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": self.num_hidden_layers,
            "initializer_range": self.initializer_range, "bos_token_id": self.bos_token_id,
            "eos_token_id": eos, "pad_token_id": self.pad_token_id, "use_cache": True,
            "torch_dtype": self.param_dtype,
        }

    @property
    def compute_dtype(self):
        """``jnp.dtype`` of ``dtype``: activations and matmul inputs."""
        return jnp.dtype(self.dtype)

    @property
    def weight_dtype(self):
        """``jnp.dtype`` of ``param_dtype``: how the parameters are stored."""
        return jnp.dtype(self.param_dtype)


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


def _linear(cfg: Qwen3Config, din: int, dout: int, rngs: nnx.Rngs) -> Linear:
    return Linear(din, dout, use_bias=False, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype,
                  kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query attention with per-head q_norm/k_norm before RoPE."""

    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.head_dim
        self.q_proj = _linear(cfg, cfg.hidden_size, cfg.num_attention_heads * h, rngs)
        self.k_proj = _linear(cfg, cfg.hidden_size, cfg.num_key_value_heads * h, rngs)
        self.v_proj = _linear(cfg, cfg.hidden_size, cfg.num_key_value_heads * h, rngs)
        self.o_proj = _linear(cfg, cfg.num_attention_heads * h, cfg.hidden_size, rngs)
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


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.gate_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.up_proj = _linear(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.down_proj = _linear(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)

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


class Qwen3(nnx.Module):
    """Qwen3 causal decoder returning final hidden states; see the module docstring and :class:`KVCache`."""

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=config.compute_dtype,
                                      param_dtype=config.weight_dtype,
                                      embedding_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)

        @nnx.split_rngs(splits=config.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(r):
            return DecoderLayer(config, r)

        self.layers = make_layers(rngs)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype)
        self.lm_head = None if config.tie_word_embeddings else _linear(
            config, config.hidden_size, config.vocab_size, rngs)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array, *, positions: Optional[jax.Array] = None,
                 cache: Optional[KVCache] = None, layers: Optional[tuple] = None,
                 segment_ids: Optional[jax.Array] = None, prefill: bool = False, kernel_layout: str = "in_out"
                 ) -> tuple[jax.Array, Optional[KVCache]]:
        """Run the decoder.

        Without a cache the stacked layers run under ``jax.lax.scan`` (with the configured remat); with a
        cache they run in a Python loop over the per-layer cache buffers (see the module docstring).

        Args:
          input_ids: [B, T] int32 token ids (pad ids anywhere; they are masked by ``attention_mask``).
          attention_mask: [B, T] bool/int, 1 on real tokens.
          positions: [B, T] int32 RoPE positions; default from the mask (plus ``cache.next_position``).
            Packed rows pass per-sequence positions (restarting at 0 for each segment).
          cache: optional :class:`KVCache`; the T tokens are written at ``cache.length`` per row.
          layers: with a cache only: the L per-layer parameter states (``models.decode.DecodeParams.layers``)
            to use instead of slicing the stacked ``self.layers``. XLA:CPU materialises every static slice of
            the stacked weights up front (a temporary as large as all layer weights, 2-3x slower steps), so
            the rollout engine keeps its parameters per layer and passes them here.
          kernel_layout: with ``layers`` only: how their :class:`Linear` kernels are held, ``"in_out"`` (as the
            parameters) or ``"out_in"`` (transposed, ``models.decode.DecodeParams.kernel_layout``).
          segment_ids: without a cache only: [B, T] int ids of packed sequences (tokens attend only within
            their segment; 0 or ``attention_mask == 0`` is padding). Default: the attention mask.
          prefill: with a cache only: the cache is empty (``length == 0`` on every row, as
            ``init_cache`` makes it), so the T tokens attend to each other with the configured attention
            kernel (``config.attention``) and are then written to the cache; decode steps (``prefill=False``)
            attend over the cache.
        Returns:
          hidden: [B, T, hidden_size] in the compute dtype, after the final norm;
          the updated cache (``None`` when no cache was given).
        Raises:
          ValueError: mismatched shapes between ``input_ids``, ``attention_mask``, ``segment_ids`` and the
            cache, or a cache with another number of layers than the model; ``layers`` without a cache or of
            the wrong length; ``segment_ids`` with a cache or ``prefill`` without one; ``kernel_layout`` other
            than ``"in_out"`` without ``layers`` (or unknown).
        """
        cfg = self.config
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must both be [B, T]")
        b, t = input_ids.shape
        valid = attention_mask.astype(bool)
        rel = positions_from_mask(valid)
        if segment_ids is not None and (cache is not None or segment_ids.shape != input_ids.shape):
            raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {input_ids.shape} and is only "
                             f"used without a cache")
        if prefill and cache is None:
            raise ValueError("prefill=True needs a cache (an empty one from init_cache)")
        seg = segment_ids_from_mask(valid) if segment_ids is None else jnp.where(valid, segment_ids, 0)
        if cache is None:
            if positions is None:
                positions = rel
            write_index = None
        else:
            if len(cache.k) != cfg.num_hidden_layers or len(cache.v) != cfg.num_hidden_layers:
                raise ValueError(f"cache has {len(cache.k)} key / {len(cache.v)} value layers, the model "
                                 f"{cfg.num_hidden_layers}")
            if cache.batch_size != b:
                raise ValueError(f"cache has {cache.batch_size} rows but input_ids has batch {b}")
            if positions is None:
                positions = cache.next_position[:, None] + rel
            q_index = cache.length[:, None] + jnp.arange(t)[None]
            write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=0))
            key_mask = write(cache.key_mask, valid, cache.length)
            k_index = jnp.arange(cache.max_length)
            write_index = cache.length
        mask = None
        if cache is not None and not prefill:
            mask = (key_mask[:, None, :] & (k_index[None, None, :] <= q_index[:, :, None]))[:, None]  # [B,1,T,S]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        x = constrain(self.embed_tokens(input_ids), ("batch", None, None))

        graphdef, layer_state = nnx.split(self.layers)
        if cache is None and layers is not None:
            raise ValueError("layers (per-layer parameters) is only used together with a cache")
        if cache is None:
            def body(h, st):
                return nnx.merge(graphdef, st)(h, cos, sin, None, segment_ids=seg.astype(jnp.int32))[0], None

            x, _ = jax.lax.scan(remat_layer(body, cfg.remat), x, layer_state, unroll=cfg.scan_unroll)
            return self.norm(x), None

        if layers is not None and len(layers) != cfg.num_hidden_layers:
            raise ValueError(f"layers has {len(layers)} entries, the model {cfg.num_hidden_layers}")
        if kernel_layout != "in_out" and layers is None:
            raise ValueError(f"kernel_layout={kernel_layout!r} needs per-layer parameters (layers)")
        ks, vs = [], []
        for i in range(cfg.num_hidden_layers):  # per-layer cache buffers: see the module docstring
            st = layers[i] if layers is not None else jax.tree.map(lambda a: a[i], layer_state)
            layer = nnx.merge(graphdef, st)
            if kernel_layout != "in_out":
                set_kernel_layout(layer, kernel_layout)
            x, (k_i, v_i) = layer(x, cos, sin, mask, (cache.k[i], cache.v[i]), write_index,
                                  seg.astype(jnp.int32) if prefill else None)
            ks.append(k_i)
            vs.append(v_i)
        hidden = self.norm(x)
        new_cache = KVCache(k=tuple(ks), v=tuple(vs), key_mask=key_mask, length=cache.length + t,
                            next_position=cache.next_position + valid.sum(-1).astype(jnp.int32))
        return hidden, new_cache

    def lm_head_weight(self) -> jax.Array:
        """The LM head as a [hidden_size, vocab_size] matrix (the embedding transposed when tied; see
        :meth:`lm_head_weight_and_layout`, which says which one is stored)."""
        w, layout = self.lm_head_weight_and_layout()
        return w.T if layout == "vd" else w

    def lm_head_weight_and_layout(self) -> tuple[jax.Array, str]:
        """The LM head weight as stored and its layout, for ``chunked_log_probs_and_entropy(weight_layout=...)``.

        Returns ``(embedding [vocab_size, hidden_size], "vd")`` when tied (no transposed copy; its gradient is
        the embedding's gradient as stored) and ``(kernel [hidden_size, vocab_size], "dv")`` otherwise, in the
        parameters' dtype. No errors raised. Source: HF ``tie_word_embeddings`` (Tunix ``x @ embedding.T``).
        """
        if self.lm_head is None:
            return self.embed_tokens.embedding[...], "vd"
        return self.lm_head.kernel[...], "dv"

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Logits [..., vocab_size] float32 from hidden [..., hidden_size] (f32 accumulation).

        The operands enter the matmul in their own dtypes, with float32 accumulation
        (``preferred_element_type``), as the trainer's chunked log-probs do: a bf16 LM head is read as stored
        instead of being copied to float32 on every decode step (bench/bench_decode_step.py); the products of
        bf16 values are exact in float32, so only the summation order can differ from a float32 matmul.

        Materialises the full vocabulary; loss code should use ``stapo_jax.algo.logprobs`` (chunked) instead.
        """
        w, layout = self.lm_head_weight_and_layout()
        return jnp.einsum(f"...d,{layout}->...v", hidden, w, preferred_element_type=jnp.float32)


def param_count(config: Qwen3Config) -> int:
    """Number of parameters, from abstract shapes only (``nnx.eval_shape``; nothing is allocated).
    Returns an int; never raises (a ``Qwen3Config`` is validated when built: ConfigError).
    Source: as HF ``model.num_parameters()`` (tied embeddings counted once)."""
    abstract = nnx.eval_shape(lambda: Qwen3(config, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    total = 0
    for leaf in leaves:
        n = 1
        for d in leaf.shape:
            n *= d
        total += n
    return total
