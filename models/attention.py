"""Causal self-attention kernels behind one switch (``Qwen3Config.attention`` / ``model.attention``).

Every implementation computes, for queries q ``[B, T, N, H]`` and keys/values k, v ``[B, T, Nkv, H]``
(grouped-query attention, ``N = Nkv · G``; query head ``n`` uses KV head ``n // G`` like HF ``repeat_kv``,
and no implementation materialises the repeated K/V)::

    out[b, t, n] = softmax_s(scale · q[b, t, n] · k[b, s, n // G] over visible s) · v[b, s, n // G]

where key ``s`` is visible to query ``t`` iff ``segment_ids[b, s] == segment_ids[b, t] != 0`` and
``s <= t`` (causal). ``segment_ids`` is ``[B, T]`` int32: 0 marks padding (any position, left or right), and
equal positive ids mark one sequence; several sequences packed into one row get different ids (verl's
packed variable-length attention, MaxText/Tunix segment ids). For an unpacked batch it is just the attention
mask as int32 (:func:`segment_ids_from_mask`). Outputs at padding queries (segment 0) are finite but
unspecified; callers mask them out.

Implementations (``IMPLEMENTATIONS``):

* ``xla``: materialised float32 logits and a plain softmax, as ``jax.nn.dot_product_attention(implementation=
  "xla")`` with a ``[B, 1, T, T]`` boolean mask, in static query blocks that skip the keys after them
  (:func:`xla_attention`; about half the ``T²`` logits when causal). The reference.
* ``blockwise``: flash-style attention in pure JAX (Dao et al. 2022, FlashAttention, Alg. 1/2): an outer
  loop over query blocks, an online softmax over key blocks up to the diagonal, and a ``jax.custom_vjp``
  whose backward recomputes each block's probabilities from the saved log-sum-exp, so forward + backward
  temporaries are O(B · N · T · block) instead of O(B · N · T²). Query block ``i`` visits only key blocks
  ``kv_lo[i] .. kv_hi[i]`` that its segments reach in some row (:func:`block_ranges`; the backward likewise),
  so a row packing short sequences costs about the sum of their squared lengths (verl's varlen flash
  attention), not T². Runs on CPU, GPU and TPU.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)`` with the segment mask
  (GPU, bfloat16/float16 only). cuDNN skips the non-causal half; the boolean segment mask is turned into a
  ``[B, 1, T, T]`` bias in the compute dtype by JAX (one per row, not per head). JAX's public API takes no
  packed-segment form (``query_seq_lengths`` / ``key_value_seq_lengths`` are one length per row: padding only);
  cuDNN's packed layout (``q_offsets`` / ``kv_offsets``) exists only in the private
  ``jax._src.cudnn.fused_attention_stablehlo``, so packed rows for cuDNN stay at most ``P + R`` tokens
  (``stapo_jax.train.packing.packing_long_rows``).
* ``splash``: ``jax.experimental.pallas.ops.tpu.splash_attention`` (TPU), causal mask plus ``SegmentIds``,
  one multi-query kernel per KV head (``make_splash_mqa`` over the G query heads that share it), vmapped
  over batch and KV heads and run under ``jax.shard_map`` on the active mesh (batch over data/fsdp, heads
  over tensor). ``interpret=True`` runs the same kernel in Pallas interpret mode (any backend; tests).
* ``auto``: :func:`resolve_implementation` picks splash on TPU, cuDNN on GPU for 16-bit dtypes, else
  blockwise; the choice is logged once per (backend, dtype).
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models.platform import mesh_platform

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("xla", "blockwise", "cudnn", "splash", "auto")
DEFAULT_BLOCK = 512  # query/key block of the blockwise kernel (tokens)
_NEG = -1e30  # masked logit for the blockwise kernel (finite: no inf - inf)
XLA_QUERY_BLOCK = 128  # query block of the xla implementation (tokens; fastest at T=512..1024 on CPU)
XLA_MAX_QUERY_BLOCKS = 16  # the xla implementation unrolls at most this many query blocks
_LOGGED: set = set()


class AttentionError(ValueError):
    """An unknown implementation, one that cannot run on this backend/dtype, or bad attention inputs."""


def segment_ids_from_mask(attention_mask: jax.Array) -> jax.Array:
    """[B, T] bool/int attention mask (1 = real token) -> [B, T] int32 segment ids (1 real, 0 padding).
    Never raises. Source: the segment-id convention of splash attention / MaxText (0 = padding)."""
    return attention_mask.astype(bool).astype(jnp.int32)


def resolve_implementation(name: str, dtype, backend: Optional[str] = None) -> str:
    """The concrete implementation for ``name`` on ``backend`` (default: the active mesh's platform).

    Args:
      name: one of :data:`IMPLEMENTATIONS`.
      dtype: the compute dtype of q/k/v (a numpy/jax dtype or its name).
      backend: ``"cpu" | "gpu" | "cuda" | "rocm" | "tpu"``; default the platform of the active mesh's devices
        (:func:`models.platform.mesh_platform`: the target's when compiling for a TPU / GPU topology on a CPU host),
        else the default backend.
    Returns:
      ``"xla" | "blockwise" | "cudnn" | "splash"``. ``auto`` -> splash on TPU; cudnn on an NVIDIA GPU for
      bfloat16/float16; blockwise otherwise (CPU, fp32 on GPU, ROCm). The auto choice is logged once.
    Raises:
      AttentionError: unknown name; ``cudnn`` off an NVIDIA GPU or with a dtype other than bf16/fp16.
      (``splash`` is accepted anywhere: off TPU it needs ``interpret=True``, checked by the kernel call.)
    Source: MaxText's / Tunix's choice (splash on TPU, cuDNN flash on NVIDIA GPU for half precision).
    """
    if name not in IMPLEMENTATIONS:
        raise AttentionError(f"model.attention={name!r}: expected one of {list(IMPLEMENTATIONS)}")
    backend = backend or mesh_platform()
    dt = jnp.dtype(dtype)
    half = dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if name == "auto":
        if backend == "tpu":
            choice = "splash"
        elif backend in ("gpu", "cuda") and half:
            choice = "cudnn"
        else:
            choice = "blockwise"
        if (backend, dt.name) not in _LOGGED:
            _LOGGED.add((backend, dt.name))
            log.info("model.attention=auto -> %s (backend %s, dtype %s)", choice, backend, dt.name)
        return choice
    if name == "cudnn" and (backend not in ("gpu", "cuda") or not half):
        raise AttentionError(f"model.attention='cudnn' needs an NVIDIA GPU and bfloat16/float16 inputs; "
                             f"got backend {backend!r}, dtype {dt.name}")
    return name


def _check(q, k, v, segment_ids):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise AttentionError(f"attention: q {q.shape} must be [B, T, N, H] and k {k.shape}, v {v.shape} "
                             f"equal [B, T, Nkv, H]")
    b, t, n, h = q.shape
    if k.shape[0] != b or k.shape[1] != t or k.shape[3] != h or n % k.shape[2]:
        raise AttentionError(f"attention: q {q.shape} and k {k.shape} disagree (self-attention needs equal "
                             f"B, T, H and N a multiple of Nkv)")
    if segment_ids.shape != (b, t):
        raise AttentionError(f"attention: segment_ids {segment_ids.shape} must be [B, T] = {(b, t)}")


def segment_mask(segment_ids: jax.Array, causal: bool = True) -> jax.Array:
    """[B, 1, T, T] bool: key s visible to query t (same nonzero segment, and s <= t when causal).
    ``segment_ids``: [B, T] int. Never raises. Source: the ``mask`` argument of
    ``jax.nn.dot_product_attention`` (True = attend), segment semantics as splash attention."""
    seg = segment_ids
    m = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    if causal:
        t = seg.shape[1]
        m = m & jnp.tril(jnp.ones((t, t), bool))[None]
    return m[:, None]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                          implementation: str = "xla", scale: Optional[float] = None, causal: bool = True,
                          block_size: int = DEFAULT_BLOCK, interpret: bool = False) -> jax.Array:
    """Masked (grouped-query) self-attention with the chosen implementation; see the module docstring.

    Args:
      q: [B, T, N, H] queries; k, v: [B, T, Nkv, H] (any float dtype; cast to q's dtype).
      segment_ids: [B, T] int, 0 = padding, equal positive ids = one (packed) sequence.
      implementation: one of :data:`IMPLEMENTATIONS` (``auto`` is resolved with q's dtype).
      scale: logit scale, default ``H ** -0.5``.
      causal: causal mask on top of the segment mask.
      block_size: blockwise / splash tile (tokens); T is padded up to a multiple of it when T > block_size.
      interpret: splash only: run the Pallas kernel in interpret mode (CPU tests).
    Returns:
      [B, T, N, H] in q's dtype (float32 softmax statistics inside every implementation).
    Raises:
      AttentionError: bad shapes, unknown implementation, or one unavailable here.
    Source: ``jax.nn.dot_product_attention`` (xla / cudnn), FlashAttention (Dao et al., 2022) for blockwise,
    ``jax.experimental.pallas.ops.tpu.splash_attention`` for splash.
    """
    _check(q, k, v, segment_ids)
    impl = resolve_implementation(implementation, q.dtype)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    segment_ids = segment_ids.astype(jnp.int32)
    if impl == "xla":
        return xla_attention(q, k, v, segment_ids, scale=scale, causal=causal)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids, False), scale=scale,
                                            is_causal=causal, implementation="cudnn")
    if impl == "splash":
        return splash_attention(q, k, v, segment_ids, scale=scale, causal=causal, block_size=block_size,
                                interpret=interpret)
    return blockwise_attention(q, k, v, segment_ids, scale=scale, causal=causal, block_size=block_size)


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, scale: float,
                  causal: bool = True, query_block: int = XLA_QUERY_BLOCK) -> jax.Array:
    """Masked attention with materialised logits, split into static query blocks that skip the keys after them.

    Query block ``[i0, i1)`` scores only keys ``[0, i1)`` when ``causal`` (the later keys are masked for every
    one of its queries), so the causal logits cost about half of ``T²``; one block of all T when not causal or
    T <= ``query_block``. The block is ``max(query_block, ceil(T / XLA_MAX_QUERY_BLOCKS))`` tokens (at most 16
    unrolled blocks, so compile time stays bounded). Each block is a plain softmax over its visible keys in
    float32 with the GQA query heads of a KV head stacked into one ``[G·block, H] x [H, keys]`` product per
    KV head (no repeated K/V). Values equal ``jax.nn.dot_product_attention(implementation="xla")`` with
    :func:`segment_mask` (the same terms summed; masked keys add exactly 0); autodiff gives the backward.
    Measured (``bench/bench_attention.py``, fp32, 16 query / 8 KV heads of 128, one 2-core CPU): forward +
    backward at T=512 1.3-1.6x faster than ``jax.nn``'s (five runs), and at T=1024 1.9x.

    Args: q [B, T, N, H]; k, v [B, T, Nkv, H] in q's dtype; segment_ids [B, T] int32 (0 = padding); scale
    (float); causal; query_block (tokens, > 0).
    Returns [B, T, N, H] in q's dtype; queries with no visible key (padding) get finite, unspecified values.
    Memory: the saved probabilities are float32 ``[B, N, block, keys]`` per block, about ``B·N·T²/2`` in all
    when causal. Raises: AttentionError: ``query_block`` <= 0. Source: ``jax.nn.dot_product_attention``'s
    xla path; the causal block skipping of FlashAttention (Dao et al., 2022) without its online softmax.
    """
    if query_block <= 0:
        raise AttentionError(f"attention query_block={query_block} must be positive")
    b, t, n, h = q.shape
    block = max(int(query_block), -(-t // XLA_MAX_QUERY_BLOCKS)) if causal else t
    qh, kh, vh = _heads_major(q, k, v)                                # [B, K, G, T, H], [B, K, T, H]
    outs = []
    for i0 in range(0, t, block):
        i1 = min(t, i0 + block)
        keys = i1 if causal else t
        mask = _block_mask(segment_ids[:, i0:i1], segment_ids[:, :keys], i0, 0, causal)
        s = jnp.where(mask, _scores(qh[:, :, :, i0:i1], kh[:, :, :keys], scale), _NEG)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        outs.append(jnp.einsum("bkgqs,bksh->bkgqh", p, vh[:, :, :keys], preferred_element_type=jnp.float32))
    o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)   # [B, K, G, T, H]
    return o.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def pad_to_block(t: int, block_size: int) -> tuple[int, int]:
    """(block, padded length) for a length-``t`` axis: one block of T when T <= block_size, else T rounded
    up to a multiple of ``block_size`` (the padded tail gets segment id 0). Takes and returns Python
    ints. Raises: AttentionError: ``block_size`` <= 0. Source: this module's
    tiling (FlashAttention's block loop needs whole blocks)."""
    if block_size <= 0:
        raise AttentionError(f"attention block_size={block_size} must be positive")
    if t <= block_size:
        return t, t
    return block_size, -(-t // block_size) * block_size


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                        scale: float, causal: bool = True, block_size: int = DEFAULT_BLOCK) -> jax.Array:
    """Flash-style attention in pure JAX (FlashAttention Alg. 1 forward, recomputing backward).

    Args: q [B, T, N, H]; k, v [B, T, Nkv, H] in q's dtype; segment_ids [B, T] int32 (0 = padding);
    scale (float); causal; block_size (tokens per query/key block).
    Returns [B, T, N, H] in q's dtype. Fully masked (padding) queries get 0.
    Memory: forward keeps q, k, v, the output and a float32 log-sum-exp [B, T, N]; temporaries are
    O(B · N · block²) per step, so forward + backward is linear in T.
    Raises: nothing beyond JAX's shape errors (callers validate through :func:`dot_product_attention`).
    Source: FlashAttention (Dao et al., 2022), Algorithm 1 (online softmax) and its recomputing backward.
    """
    b, t, n, h = q.shape
    block, tp = pad_to_block(t, block_size)
    if tp != t:
        pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, tp - t)])
    out = _flash(q, k, v, segment_ids, float(scale), int(block), bool(causal))
    return out[:, :t]


def _block_mask(seg_q, seg_k, q0, k0, causal):
    """[B, 1, 1, bq, bk] visibility of one (query block, key block) pair."""
    m = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] != 0)
    if causal:
        qi = q0 + jnp.arange(seg_q.shape[1])
        ki = k0 + jnp.arange(seg_k.shape[1])
        m = m & (qi[:, None] >= ki[None, :])
    return m[:, None, None]


def _slice(x, i, block, axis=1):
    return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=axis)


def _scores(qi, kj, scale):
    """qi [B, K, G, bq, H], kj [B, K, bk, H] -> float32 [B, K, G, bq, bk]."""
    return jnp.einsum("bkgqh,bksh->bkgqs", qi, kj, preferred_element_type=jnp.float32) * jnp.float32(scale)


def _queries_heads_major(q, nkv):
    """q [B, T, N, H] -> [B, K, G, T, H] (query head n = KV head n // G, member n % G)."""
    b, t, n, h = q.shape
    return q.reshape(b, t, nkv, n // nkv, h).transpose(0, 2, 3, 1, 4)


def _heads_major(q, k, v):
    """q [B, T, N, H] -> [B, K, G, T, H]; k, v [B, T, K, H] -> [B, K, T, H]: each block's products then read
    contiguous rows (one transpose per call instead of one per block pair)."""
    return _queries_heads_major(q, k.shape[2]), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def block_ranges(seg: jax.Array, block: int, causal: bool) -> tuple[jax.Array, ...]:
    """Which key blocks each query block can see, from the segment ids (shared by all rows of the batch).

    Args: seg [B, T] int32 (T a multiple of ``block``; 0 = padding); block (tokens); causal.
    Returns: ``(kv_lo, kv_hi, q_lo, q_hi)``, [T / block] int32 each: query block ``i`` needs only key blocks
    ``kv_lo[i] .. kv_hi[i]`` (inclusive) and key block ``j`` only query blocks ``q_lo[j] .. q_hi[j]``, over
    every row (a superset of the visible blocks: a key outside its query's segment is never in range unless
    another row or query of the block needs that block). A packed row of short sequences thus costs about
    the sum of their squared lengths, not T^2. Padding queries (segment 0) see nothing and need only their own
    block. Computed per row with a sort (any positive segment ids, contiguous or not), O(B T log T).
    Raises: nothing (T not a multiple of ``block`` is the caller's bug: the reshape fails). Source: the
    block-sparse skipping of splash attention's masks, computed here from segment ids.
    """
    b, t = seg.shape
    nb = t // block
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def row(s):  # first and last position of each token's segment id
        rank = jnp.searchsorted(jnp.sort(s), s).astype(jnp.int32)   # the same rank for equal ids, in [0, T)
        first = jnp.full((t,), t, jnp.int32).at[rank].min(pos[0])
        last = jnp.full((t,), -1, jnp.int32).at[rank].max(pos[0])
        return first[rank], last[rank]

    first, last = jax.vmap(row)(seg)
    first = jnp.where(seg > 0, first, pos)
    last = jnp.where(seg > 0, pos if causal else last, pos)
    lo = first.reshape(b, nb, block).min((0, 2)) // block          # [nb]
    hi = last.reshape(b, nb, block).max((0, 2)) // block
    qi, kj = jnp.arange(nb)[:, None], jnp.arange(nb)[None, :]
    vis = (kj >= lo[:, None]) & (kj <= hi[:, None])                 # [nb q, nb k], diagonal always True
    big = jnp.int32(nb)
    kv_lo = jnp.where(vis, kj, big).min(1)
    kv_hi = jnp.where(vis, kj, -1).max(1)
    q_lo = jnp.where(vis, qi, big).min(0)
    q_hi = jnp.where(vis, qi, -1).max(0)
    return kv_lo, kv_hi, q_lo, q_hi


def _forward(q, k, v, seg, scale, block, causal):
    """Output [B, T, N, H] and the float32 log-sum-exp [B, K, G, T] of every query."""
    b, t, n, h = q.shape
    nkv = k.shape[2]
    g = n // nkv
    nb = t // block
    qh, kh, vh = _heads_major(q, k, v)
    kv_lo, kv_hi, _, _ = block_ranges(seg, block, causal)

    def q_block(i):
        qi, sq = _slice(qh, i, block, 3), _slice(seg, i, block)

        def kv_step(j, carry):
            m, l, acc = carry
            kj, vj, sk = _slice(kh, j, block, 2), _slice(vh, j, block, 2), _slice(seg, j, block)
            mask = _block_mask(sq, sk, i * block, j * block, causal)
            s = jnp.where(mask, _scores(qi, kj, scale), _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            l = l * corr + p.sum(-1)
            pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l, acc * corr[..., None] + pv

        init = (jnp.full((b, nkv, g, block), _NEG, jnp.float32), jnp.zeros((b, nkv, g, block), jnp.float32),
                jnp.zeros((b, nkv, g, block, h), jnp.float32))
        m, l, acc = jax.lax.fori_loop(kv_lo[i], kv_hi[i] + 1, kv_step, init)
        o = acc / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)
        return o.astype(q.dtype), lse                                  # [B,K,G,bq,H], [B,K,G,bq]

    o, lse = jax.lax.map(q_block, jnp.arange(nb))                      # [nb, B, K, G, bq, ...]
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, n, h)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, nkv, g, t)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, scale, block, causal):
    return _forward(q, k, v, seg, scale, block, causal)[0]


def _flash_fwd(q, k, v, seg, scale, block, causal):
    o, lse = _forward(q, k, v, seg, scale, block, causal)
    return o, (q, k, v, seg, o, lse)


def _flash_bwd(scale, block, causal, res, do):
    q, k, v, seg, o, lse = res
    b, t, n, h = q.shape
    nkv = k.shape[2]
    g = n // nkv
    nb = t // block
    qh, kh, vh = _heads_major(q, k, v)
    doh = _queries_heads_major(do, nkv)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), -1).reshape(b, t, nkv, g).transpose(0, 2, 3, 1)
    _, _, q_lo, q_hi = block_ranges(seg, block, causal)

    def kv_block(j, carry):
        dq, dk, dv = carry
        kj, vj, sk = _slice(kh, j, block, 2), _slice(vh, j, block, 2), _slice(seg, j, block)

        def q_step(i, c):
            dq, dkj, dvj = c
            qi, doi, sq = _slice(qh, i, block, 3), _slice(doh, i, block, 3), _slice(seg, i, block)
            lse_i = _slice(lse, i, block, 3)[..., None]                # [B,K,G,bq,1]
            delta_i = _slice(delta, i, block, 3)[..., None]
            mask = _block_mask(sq, sk, i * block, j * block, causal)
            p = jnp.where(mask, jnp.exp(_scores(qi, kj, scale) - lse_i), 0.0)
            dvj = dvj + jnp.einsum("bkgqs,bkgqh->bksh", p.astype(do.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bkgqh,bksh->bkgqs", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i) * jnp.float32(scale)
            dqi = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i, block, 3) + dqi, i * block, axis=3)
            dkj = dkj + jnp.einsum("bkgqs,bkgqh->bksh", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32)
            return dq, dkj, dvj

        zero = jnp.zeros((b, nkv, block, h), jnp.float32)
        dq, dkj, dvj = jax.lax.fori_loop(q_lo[j], q_hi[j] + 1, q_step, (dq, zero, zero))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * block, axis=2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * block, axis=2)
        return dq, dk, dv

    init = (jnp.zeros((b, nkv, g, t, h), jnp.float32), jnp.zeros((b, nkv, t, h), jnp.float32),
            jnp.zeros((b, nkv, t, h), jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, nb, kv_block, init)
    dq = dq.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return dq.astype(q.dtype), jnp.swapaxes(dk, 1, 2).astype(k.dtype), jnp.swapaxes(dv, 1, 2).astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------------- splash (TPU)
# Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``); its Pallas module is imported only
# when chosen (in :func:`_splash_kernel`).
#
# Per KV head a multi-query kernel (``make_splash_mqa``: G query heads over one key/value head, the MaxText /
# Tunix GQA layout, no repeated K/V), with a causal mask over the G heads and ``SegmentIds`` for padding and
# packing; vmapped over batch and KV heads. When a mesh is active (``jax.set_mesh``) the call runs under
# ``jax.shard_map`` with the batch over ``("data", "fsdp")`` and heads over ``"tensor"`` (each axis only
# where it divides the dimension, as :func:`models.sharding.logical_to_spec` does for activations), so
# every device runs the kernel on its local rows and heads; the kernel itself needs no communication.


def _splash_kernel(t: int, g: int, block: int, causal: bool, interpret: bool):
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


def _splash_local(q, k, v, seg, *, scale, causal, block, interpret):
    """Unsharded body: q [B, T, N, H], k/v [B, T, K, H], seg [B, T] -> [B, T, N, H]."""
    b, t, n, h = q.shape
    nkv = k.shape[2]
    g = n // nkv
    kernel, segment_ids = _splash_kernel(t, g, block, causal, interpret)
    qh = (q * jnp.asarray(scale, q.dtype)).reshape(b, t, nkv, g, h).transpose(0, 2, 3, 1, 4)  # [B,K,G,T,H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B,K,T,H]

    def one_row(qr, kr, vr, sr):
        ids = segment_ids(q=sr, kv=sr)
        return jax.vmap(lambda a, b_, c: kernel(a, b_, c, segment_ids=ids))(qr, kr, vr)

    out = jax.vmap(one_row)(qh, kh, vh, seg)  # [B,K,G,T,H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _mesh_axes(mesh, names, dim):
    """The mesh axes of ``names`` (in order) whose running product divides ``dim``; None when none do."""
    keep, size = [], 1
    for a in names:
        if a in mesh.axis_names and dim % (size * mesh.shape[a]) == 0:
            keep.append(a)
            size *= mesh.shape[a]
    return tuple(keep) or None


def splash_attention(q, k, v, segment_ids, *, scale: float, causal: bool = True, block_size: int = 512,
                     interpret: bool = False):
    """Splash attention with segment ids and GQA; see :func:`dot_product_attention` for the contract.

    Args: q [B, T, N, H]; k, v [B, T, Nkv, H] (q's dtype); segment_ids [B, T] int32 (0 = padding);
    scale; causal; block_size (tile, tokens; rounded down to a multiple of 128, at least 128; T is padded
    with segment id 0 to a multiple of the tile); interpret (Pallas interpret mode, any backend).
    Returns [B, T, N, H] in q's dtype.
    Raises:
      AttentionError: off TPU without ``interpret=True`` (the kernel is Mosaic TPU code; the platform is the active
        mesh's, :func:`models.platform.mesh_platform`).
    Source: ``jax.experimental.pallas.ops.tpu.splash_attention`` (multi-query kernels per KV head, as MaxText).
    """
    if not interpret and mesh_platform() != "tpu":
        raise AttentionError(f"model.attention='splash' runs on TPU (platform of the mesh here: {mesh_platform()}); "
                             f"use 'blockwise' or 'auto'")
    b, t, n, h = q.shape
    lanes = 128  # Mosaic tiles: every splash block is a multiple of 128 tokens
    block = lanes * max(1, min(block_size, -(-t // lanes) * lanes) // lanes)
    tp = -(-t // block) * block
    if tp != t:
        pad = [(0, 0), (0, tp - t), (0, 0), (0, 0)]
        q, k, v = jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad)
        segment_ids = jnp.pad(segment_ids, [(0, 0), (0, tp - t)])
    body = lambda q_, k_, v_, s_: _splash_local(q_, k_, v_, s_, scale=scale, causal=causal, block=block,
                                         interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return body(q, k, v, segment_ids)[:, :t]
    batch = _mesh_axes(mesh, ("data", "fsdp"), b)
    heads = _mesh_axes(mesh, ("tensor",), k.shape[2])
    spec_q = P(batch, None, heads, None)
    out = jax.shard_map(body, in_specs=(spec_q, spec_q, spec_q, P(batch, None)), out_specs=spec_q,
                        check_vma=False)(q, k, v, segment_ids)
    return out[:, :t]
