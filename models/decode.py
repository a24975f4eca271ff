"""Jitted prefill / one-token decode over the Qwen3 KV cache, and a greedy generator built on them.

These are the hot steps the rollout engine and the demo share. They take the model split as
``(graphdef, params)`` so that parameters are ordinary pytree arguments: new weights of the same shapes and
shardings reuse the compiled functions. ``params`` is either the stacked ``nnx.split(model)[1]`` (the trainer's
layout; correct, but XLA:CPU copies every layer's weights out of the stack on each call) or
:class:`DecodeParams` from :func:`split_layers` (one state per layer: no copies; what the rollout engine uses).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.linear import check_kernel_layout, preferred_kernel_layout
from models.platform import mesh_platform
from models.qwen3 import Qwen3
from models.kv_cache import KVCache, init_cache
from models.sharding import param_path

LAYERS_KEY = "layers"  # the stacked decoder layers in nnx.state(Qwen3)


@flax.struct.dataclass
class DecodeParams:
    """Qwen3 parameters laid out for cached decoding (see :meth:`models.qwen3.Qwen3.__call__`'s ``layers``).

    Fields:
      rest: ``nnx.State`` of everything but the decoder layers (embedding, final norm, LM head).
      layers: tuple of L ``nnx.State``, one per decoder layer, each leaf the stacked leaf's ``[i]`` slice
        (same dtype; shape without the leading layer axis; :class:`~models.linear.Linear` kernels transposed
        to [out, in] when ``kernel_layout == "out_in"``).
      kernel_layout: static str, ``"in_out"`` (the parameters' layout) or ``"out_in"`` (see
        :mod:`models.linear`: faster decode steps on XLA:CPU).
    """

    rest: Any
    layers: tuple
    kernel_layout: str = flax.struct.field(pytree_node=False, default="in_out")


def is_kernel(path) -> bool:
    """True for the pytree path of a :class:`~models.linear.Linear` kernel (dotted name ending in ``kernel``).
    Takes a pytree key path, returns a bool; raises nothing of its own. Source: the Flax ``nnx.Linear``
    parameter name."""
    return param_path(path).rsplit(".", 1)[-1] == "kernel"


def to_kernel_layout(path, layer: jax.Array, kernel_layout: str) -> jax.Array:
    """One per-layer leaf (trainer layout) in ``kernel_layout``: a kernel [in, out] becomes [out, in] for
    ``"out_in"`` (same dtype); every other leaf, and everything for ``"in_out"``, is returned as is (jittable).
    Raises ValueError for an unknown layout. Source: PyTorch ``nn.Linear`` ``weight`` [out, in]."""
    check_kernel_layout(kernel_layout)
    return layer.T if kernel_layout == "out_in" and is_kernel(path) else layer


def decode_layer_dtype(config) -> Any:
    """The dtype the decoder layers' weights are read in by the forward pass, when it is narrower than how they
    are stored; None when they are read as stored.

    Every layer weight enters the computation cast to the compute dtype (``Linear`` / ``nnx.Linear`` promote
    the kernel to ``config.compute_dtype``; :class:`~models.qwen3_layers.RMSNorm` casts its weight to the activations'
    dtype), so a decode copy of the layers kept in that dtype gives bitwise the same results in half the memory
    (``bfloat16`` compute over ``float32`` master weights: the paper configs). The embedding and LM head are
    not layers: the LM head is read in its stored dtype (:meth:`~models.qwen3.Qwen3.logits`).

    Args: config: a :class:`~models.qwen3_config.Qwen3Config`. Returns a ``jnp.dtype`` or None. Never raises.
    Source: Flax ``nnx.Linear``'s ``promote_dtype``; MaxText / JetStream serve bf16 weights of f32 checkpoints.
    """
    compute, stored = jnp.dtype(config.compute_dtype), jnp.dtype(config.weight_dtype)
    return compute if compute.itemsize < stored.itemsize else None


def unstack_layers(stacked, kernel_layout: str = "in_out", layer_dtype: Any = None) -> tuple:
    """The stacked layer state ``nnx.state(model.layers)`` (leaves [L, ...]) -> tuple of L per-layer states
    (copies; jittable with ``kernel_layout`` and ``layer_dtype`` static), kernels in ``kernel_layout``
    (:func:`to_kernel_layout`).

    Dtypes kept (bfloat16 / float32 leaves stay so), or every leaf cast to ``layer_dtype`` when given
    (:func:`decode_layer_dtype`). Raises IndexError when ``stacked`` has no leaves, ValueError for an unknown
    layout. Source: the ``nnx.scan`` stacked-layer layout of :class:`Qwen3`, unstacked for per-layer KV caches as
    JetStream / MaxText decode do.
    """
    n = jax.tree.leaves(stacked)[0].shape[0]
    cast = (lambda a: a) if layer_dtype is None else (lambda a: a.astype(layer_dtype))  # noqa: E731
    return tuple(jax.tree_util.tree_map_with_path(lambda p, a, i=i: to_kernel_layout(p, cast(a[i]), kernel_layout),
                                                  stacked) for i in range(n))


def copy_layer_into(stacked, index: jax.Array, previous, kernel_layout: str = "in_out"):
    """Layer ``index`` of the stacked layer state written into ``previous``, a per-layer state of the same
    shapes and dtypes (jittable; jit it with ``donate_argnums=2`` so that the layer's weights are copied into
    the donated buffers: no fresh allocation, no second copy of the layers alive at once, and on CPU none of
    the page faults of first-touching new memory; bench/bench_weight_sync.py). One small program serves every
    layer (``index`` is traced), so it compiles in a fraction of the time of a whole-model unstack.

    Args:
      stacked: the stacked layer state (leaves ``[L, ...]``); index: [] int32 in ``[0, L)`` (clamped, as
        ``lax.dynamic_slice``); previous: one per-layer state, leaves ``[...]`` (kernels in ``kernel_layout``);
      kernel_layout: static, as :func:`to_kernel_layout` (``"out_in"`` transposes each kernel while copying:
        about 5x the time of the plain copy on XLA:CPU, bench/bench_weight_sync.py).
    Returns:
      the per-layer state with layer ``index``'s values in the dtypes of ``previous`` (``stacked``'s, or the
      narrower :func:`decode_layer_dtype`: cast while copying).
    Raises ValueError for an unknown layout; mismatched leaf shapes raise from JAX at trace time.
    Source: JAX buffer donation (``jax.jit(donate_argnums=...)``); the layer is written with
    ``lax.dynamic_update_slice`` over the whole donated buffer, because jit drops a donated argument that the
    result does not read (it would then not alias).
    """
    def one(path, old, a):
        layer = jax.lax.dynamic_index_in_dim(a, index, axis=0, keepdims=False).astype(old.dtype)
        return jax.lax.dynamic_update_slice(old, to_kernel_layout(path, layer, kernel_layout), (0,) * old.ndim)

    return jax.tree_util.tree_map_with_path(one, previous, stacked)


_unstack_jit = jax.jit(unstack_layers, static_argnums=(1, 2))


def split_layers(state, unstack=None, kernel_layout: str = "in_out", layer_dtype: Any = None) -> DecodeParams:
    """Stacked ``nnx.split(model)[1]`` -> :class:`DecodeParams` with kernels in ``kernel_layout``.

    ``rest`` shares the arrays of ``state``; the layer weights are copied by ``unstack(stacked_layers)``
    (default: a jitted :func:`unstack_layers` with ``kernel_layout`` and ``layer_dtype``, None = as stored; the
    engine passes one jitted with its shardings, which must produce that layout and dtype).
    Raises:
      KeyError: ``state`` has no ``"layers"`` entry (not a Qwen3 state).
      ValueError: unknown ``kernel_layout``.

    Shapes / dtypes: layer leaves [L, ...] become L leaves [...] of the same dtype (or ``layer_dtype``,
    :func:`decode_layer_dtype`). Source: the ``nnx.scan``
    stacked-layer layout of :class:`Qwen3` (Flax NNX ``nnx.split``).
    """
    check_kernel_layout(kernel_layout)
    if unstack is None:
        unstack = partial(_unstack_jit, kernel_layout=kernel_layout, layer_dtype=layer_dtype)
    rest = nnx.State({k: v for k, v in state.items() if k != LAYERS_KEY})
    return DecodeParams(rest=rest, layers=tuple(unstack(state[LAYERS_KEY])), kernel_layout=kernel_layout)


def merge_model(graphdef, params) -> tuple[Qwen3, dict]:
    """``(model, kwargs)`` for ``model(..., cache=..., **kwargs)`` from either parameter layout: ``kwargs`` is
    ``{}`` for the stacked state and ``{"layers": ..., "kernel_layout": ...}`` for :class:`DecodeParams`.

    With :class:`DecodeParams` the model's stacked layer variables hold shape-only placeholders
    (``jax.ShapeDtypeStruct``, in the parameters' [in, out] kernel shapes): only the cached path, which reads
    ``layers``, may run on it.

    Never raises for a state of ``graphdef`` (Flax ``nnx.merge`` raises ValueError for a mismatched state).
    Source: Flax NNX ``nnx.split`` / ``nnx.merge``.
    """
    if not isinstance(params, DecodeParams):
        return nnx.merge(graphdef, params), {}
    n, out_in = len(params.layers), params.kernel_layout == "out_in"

    def stacked_shape(path, x):
        shape = tuple(x.shape)[::-1] if out_in and is_kernel(path) else tuple(x.shape)
        return jax.ShapeDtypeStruct((n,) + shape, x.dtype)

    placeholder = jax.tree_util.tree_map_with_path(stacked_shape, params.layers[0])
    model = nnx.merge(graphdef, nnx.State({**dict(params.rest.items()), LAYERS_KEY: placeholder}))
    return model, {"layers": params.layers, "kernel_layout": params.kernel_layout}


def last_valid_index(attention_mask: jax.Array) -> jax.Array:
    """Index of the last real token per row: [B] int32 from a [B, T] mask (0 for an all-padding row).

    Never raises (traced). Source: HF transformers' last-non-padding-token index (sequence-classification pooling
    convention).
    """
    m = attention_mask.astype(bool)
    t = m.shape[-1]
    return (t - 1 - jnp.argmax(m[:, ::-1], axis=-1)).astype(jnp.int32)


@partial(jax.jit, static_argnums=0)
def prefill(graphdef, state, input_ids: jax.Array, attention_mask: jax.Array, cache: KVCache):
    """Write a prompt batch into ``cache`` and return the logits that predict each row's next token.

    Args:
      graphdef, state: ``nnx.split(model)``; ``state`` may also be :class:`DecodeParams`.
      input_ids: [B, T] int32 prompts, left- or right-padded.
      attention_mask: [B, T], 1 on real prompt tokens.
      cache: an empty :class:`KVCache` with B rows (fresh from ``init_cache``: the prompt tokens attend to
        each other with the model's configured attention kernel, ``config.attention``).
    Returns:
      logits [B, V] float32 at each row's last real token; the updated cache.

    Raises nothing of its own (shape errors of mismatched inputs come from JAX at trace time). Source: HF
    transformers ``past_key_values`` prefill / JetStream ``Engine.prefill``.
    """
    model, kw = merge_model(graphdef, state)
    hidden, cache = model(input_ids, attention_mask, cache=cache, prefill=True, **kw)
    idx = last_valid_index(attention_mask)
    last = jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]
    return model.logits(last), cache


@partial(jax.jit, static_argnums=0)
def decode_step(graphdef, state, tokens: jax.Array, cache: KVCache, active: jax.Array | None = None):
    """Feed one token per row and return the next-token logits.

    Args:
      graphdef, state: ``nnx.split(model)``; ``state`` may also be :class:`DecodeParams`.
      tokens: [B] int32, the token each row appends.
      cache: :class:`KVCache` with B rows.
      active: optional [B] bool; inactive rows write a masked (invisible) key and keep their position.
    Returns:
      logits [B, V] float32; the updated cache.

    Raises nothing of its own (shape errors come from JAX at trace time). Source: HF transformers
    incremental decoding with ``past_key_values`` / JetStream ``Engine.generate``.
    """
    model, kw = merge_model(graphdef, state)
    mask = jnp.ones(tokens.shape, bool) if active is None else active.astype(bool)
    hidden, cache = model(tokens[:, None], mask[:, None], cache=cache, **kw)
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

    Source: HF transformers ``generate(do_sample=False)`` (greedy search, EOS kept in the output).
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be > 0")
    input_ids = jnp.asarray(input_ids, jnp.int32)
    attention_mask = jnp.asarray(attention_mask, bool)
    if input_ids.shape != attention_mask.shape or input_ids.ndim != 2:
        raise ValueError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be equal [B, T]")
    graphdef, state = nnx.split(model)
    state = split_layers(state, kernel_layout=preferred_kernel_layout(mesh_platform()))
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
