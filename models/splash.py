"""Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) for :mod:`models.attention`.

Per KV head a multi-query kernel (``make_splash_mqa``: G query heads over one key/value head, the MaxText /
Tunix GQA layout, no repeated K/V), with a causal mask over the G heads and ``SegmentIds`` for padding and
packing; vmapped over batch and KV heads. When a mesh is active (``jax.set_mesh``) the call runs under
``jax.shard_map`` with the batch over ``("data", "fsdp")`` and heads over ``"tensor"`` (each axis only
where it divides the dimension, as :func:`models.sharding.logical_to_spec` does for activations), so
every device runs the kernel on its local rows and heads; the kernel itself needs no communication.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.attention import AttentionError


def _kernel(t: int, g: int, block: int, causal: bool, interpret: bool):
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention as sa
    except ImportError as e:  # pragma: no cover - depends on the jax build
        raise AttentionError(f"model.attention='splash' needs jax.experimental.pallas.ops.tpu.splash_attention "
                             f"({e})") from e
    base = sa.CausalMask((t, t)) if causal else sa.FullMask((t, t))
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = sa.make_splash_mqa(sa.MultiHeadMask([base] * g), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                interpret=interpret)
    return kernel, sa.SegmentIds


def _local(q, k, v, seg, *, scale, causal, block, interpret):
    """Unsharded body: q [B, T, N, H], k/v [B, T, K, H], seg [B, T] -> [B, T, N, H]."""
    b, t, n, h = q.shape
    nkv = k.shape[2]
    g = n // nkv
    kernel, segment_ids = _kernel(t, g, block, causal, interpret)
    qh = (q * jnp.asarray(scale, q.dtype)).reshape(b, t, nkv, g, h).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B,K,T,H]

    def one_row(qr, kr, vr, sr):
        ids = segment_ids(q=sr, kv=sr)
        return jax.vmap(lambda a, b_, c: kernel(a, b_, c, segment_ids=ids))(qr, kr, vr)

    out = jax.vmap(one_row)(qh, kh, vh, seg)  # [B,K,G,T,H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _axes(mesh, names, dim):
    """The mesh axes of ``names`` (in order) whose running product divides ``dim``; None when none do."""
    keep, size = [], 1
    for a in names:
        if a in mesh.axis_names and dim % (size * mesh.shape[a]) == 0:
            keep.append(a)
            size *= mesh.shape[a]
    return tuple(keep) or None


def splash_attention(q, k, v, segment_ids, *, scale: float, causal: bool = True, block_size: int = 512,
                     interpret: bool = False):
    """Splash attention with segment ids and GQA; see :mod:`models.attention` for the contract.

    Args: q [B, T, N, H]; k, v [B, T, Nkv, H] (q's dtype); segment_ids [B, T] int32 (0 = padding);
    scale; causal; block_size (tile, tokens; rounded down to a multiple of 128, at least 128; T is padded
    with segment id 0 to a multiple of the tile); interpret (Pallas interpret mode, any backend).
    Returns [B, T, N, H] in q's dtype.
    Raises:
      AttentionError: off TPU without ``interpret=True`` (the kernel is Mosaic TPU code).
    Source: ``jax.experimental.pallas.ops.tpu.splash_attention`` (multi-query kernels per KV head, as MaxText).
    """
    if not interpret and jax.default_backend() != "tpu":
        raise AttentionError(f"model.attention='splash' runs on TPU (backend here: {jax.default_backend()}); "
                             f"use 'blockwise' or 'auto'")
    b, t, n, h = q.shape
    lanes = 128  # Mosaic tiles: every splash block is a multiple of 128 tokens
    block = lanes * max(1, min(block_size, -(-t // lanes) * lanes) // lanes)
    tp = -(-t // block) * block
    if tp != t:
        pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, tp - t)])
    body = lambda q_, k_, v_, s_: _local(q_, k_, v_, s_, scale=scale, causal=causal, block=block,
                                         interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return body(q, k, v, segment_ids)[:, :t]
    batch = _axes(mesh, ("data", "fsdp"), b)
    heads = _axes(mesh, ("tensor",), k.shape[2])
    spec_q = P(batch, None, heads, None)
    out = jax.shard_map(body, in_specs=(spec_q, spec_q, spec_q, P(batch, None)), out_specs=spec_q,
                        check_vma=False)(q, k, v, segment_ids)
    return out[:, :t]
