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

Split by concern: the settings in :mod:`models.qwen3_config`, the blocks (RoPE, norm, attention, MLP, decoder
layer) in :mod:`models.qwen3_layers`, the cache in :mod:`models.kv_cache`; this module stacks them into the model.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import segment_ids_from_mask
from models.kv_cache import KVCache
from models.linear import set_kernel_layout
from models.qwen3_config import Qwen3Config
from models.qwen3_layers import DecoderLayer, RMSNorm, make_linear, positions_from_mask, remat_layer, rope_cos_sin
from models.sharding import constrain

__all__ = ["Qwen3", "param_count"]


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
        self.lm_head = None if config.tie_word_embeddings else make_linear(
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
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must both be [B, T]")
        valid = attention_mask.astype(bool)
        if segment_ids is not None and (cache is not None or segment_ids.shape != input_ids.shape):
            raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] = {input_ids.shape} and is only "
                             f"used without a cache")
        if prefill and cache is None:
            raise ValueError("prefill=True needs a cache (an empty one from init_cache)")
        if cache is None and layers is not None:
            raise ValueError("layers (per-layer parameters) is only used together with a cache")
        seg = segment_ids_from_mask(valid) if segment_ids is None else jnp.where(valid, segment_ids, 0)
        x = constrain(self.embed_tokens(input_ids), ("batch", None, None))
        if cache is None:
            return self._scan_layers(x, positions_from_mask(valid) if positions is None else positions, seg), None
        return self._cached_layers(x, valid, positions, cache, layers, seg, prefill, kernel_layout)

    def _scan_layers(self, x: jax.Array, positions: jax.Array, seg: jax.Array) -> jax.Array:
        """The uncached forward: the stacked layers under ``jax.lax.scan`` (with the configured remat) over the
        embedded ``x`` [B, T, D]; returns the final-normed hidden states [B, T, D]."""
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        graphdef, layer_state = nnx.split(self.layers)

        def body(h, st):
            return nnx.merge(graphdef, st)(h, cos, sin, None, segment_ids=seg.astype(jnp.int32))[0], None

        x, _ = jax.lax.scan(remat_layer(body, cfg.remat), x, layer_state, unroll=cfg.scan_unroll)
        return self.norm(x)

    def _cached_layers(self, x: jax.Array, valid: jax.Array, positions: Optional[jax.Array], cache: KVCache,
                       layers: Optional[tuple], seg: jax.Array, prefill: bool, kernel_layout: str
                       ) -> tuple[jax.Array, KVCache]:
        """The cached forward (prefill or decode; arguments as :meth:`__call__`'s, ``x`` embedded): the layers in
        a Python loop over the per-layer cache buffers; returns (final-normed hidden [B, T, D], updated cache)."""
        cfg = self.config
        b, t = valid.shape
        if len(cache.k) != cfg.num_hidden_layers or len(cache.v) != cfg.num_hidden_layers:
            raise ValueError(f"cache has {len(cache.k)} key / {len(cache.v)} value layers, the model "
                             f"{cfg.num_hidden_layers}")
        if cache.batch_size != b:
            raise ValueError(f"cache has {cache.batch_size} rows but input_ids has batch {b}")
        if layers is not None and len(layers) != cfg.num_hidden_layers:
            raise ValueError(f"layers has {len(layers)} entries, the model {cfg.num_hidden_layers}")
        if kernel_layout != "in_out" and layers is None:
            raise ValueError(f"kernel_layout={kernel_layout!r} needs per-layer parameters (layers)")
        if positions is None:
            positions = cache.next_position[:, None] + positions_from_mask(valid)
        write = jax.vmap(lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis=0))
        key_mask = write(cache.key_mask, valid, cache.length)
        mask = None
        if not prefill:
            q_index = cache.length[:, None] + jnp.arange(t)[None]
            k_index = jnp.arange(cache.max_length)
            mask = (key_mask[:, None, :] & (k_index[None, None, :] <= q_index[:, :, None]))[:, None]  # [B,1,T,S]
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        graphdef, layer_state = nnx.split(self.layers)
        ks, vs = [], []
        for i in range(cfg.num_hidden_layers):  # per-layer cache buffers: see the module docstring
            st = layers[i] if layers is not None else jax.tree.map(lambda a: a[i], layer_state)
            layer = nnx.merge(graphdef, st)
            if kernel_layout != "in_out":
                set_kernel_layout(layer, kernel_layout)
            x, (k_i, v_i) = layer(x, cos, sin, mask, (cache.k[i], cache.v[i]), cache.length,
                                  seg.astype(jnp.int32) if prefill else None)
            ks.append(k_i)
            vs.append(v_i)
        new_cache = KVCache(k=tuple(ks), v=tuple(vs), key_mask=key_mask, length=cache.length + t,
                            next_position=cache.next_position + valid.sum(-1).astype(jnp.int32))
        return self.norm(x), new_cache

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
