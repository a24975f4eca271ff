"""Chunked token log-probabilities and entropies from hidden states and the LM head: the trainer's path, the same
quantities as :mod:`stapo_jax.algo.logprobs` (whose helpers it uses) without ever holding ``[B, T, V]`` logits.

:func:`chunked_log_probs_and_entropy` runs a streaming log-sum-exp over ``[seq_chunk, vocab_chunk]`` tiles of the
logits (EasyDeL ``_logprob_utils.py``; Tunix ``compute_chunked_logps``) and a hand-written backward
(``jax.custom_vjp``) that reads the kept logits where they fit ``max_saved_logits_bytes`` and otherwise recomputes
each tile, so long sequences never hold ``[B, T, V]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from stapo_jax.algo.logprobs import accumulation_dtype, check_temperature, log_z_and_mean_logit

__all__ = ["BACKWARD_VOCAB_CHUNK", "SAVED_LOGITS_BYTES", "chunked_log_probs_and_entropy"]

# Vocabulary tile width of the backward pass when ``vocab_chunk`` is None: the backward's float32
# head-gradient accumulator is [D, BACKWARD_VOCAB_CHUNK] instead of [D, V] (1024 x 8192 x 4 B = 32 MiB for Qwen3-0.6B).
BACKWARD_VOCAB_CHUNK = 8192

# Default byte budget of the float32 logits that the forward keeps for the backward (B * T * V * 4 bytes at most):
# above it the backward recomputes each logits tile. 512 MiB holds one Qwen3 micro-batch of 883 tokens
# (V = 151,936); at T = 4,096 (2.3 GiB of logits) the recompute path keeps the memory goal of the chunked head.
SAVED_LOGITS_BYTES = 512 * 2**20


def _tile(k, width: int, total: int, ragged: bool):
    """Start of tile ``k`` of ``width`` along an axis of length ``total`` and its mask of fresh positions.

    Tiles start at ``k * width`` except the last one of a ragged axis (``width`` does not divide ``total``),
    which is shifted back to ``total - width`` so that every tile has the same static width and no operand is
    padded; its positions already covered by the previous tile are marked stale (``fresh`` False) and ignored.
    """
    nominal = k * width
    if not ragged:
        return nominal, None
    start = jnp.minimum(nominal, total - width)
    return start, start + jnp.arange(width) >= nominal


def _slice(x, start, width: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, start, width, axis=axis)


def _put(x, update, start, axis: int):
    return jax.lax.dynamic_update_slice_in_dim(x, update, start, axis=axis)


def _fenced_slice(x, start, width: int, axis: int):
    """``_slice`` behind an optimization barrier on (operand, start), numerically a no-op. Without it the CPU
    compiler moves the float32 upcast of a bf16 matmul operand in front of the slice and hoists it out of the
    loop, i.e. materialises a float32 copy of the whole operand (``[D, V]`` for the head weight)."""
    x, start = jax.lax.optimization_barrier((x, start))
    return _slice(x, start, width, axis)


def _to_storage(x):
    """16-bit floats as their raw bits (uint16) for the head-gradient buffer; other dtypes unchanged. The
    CPU compiler has no 16-bit-float dynamic-update-slice: it would convert the whole ``[D, V]`` buffer to
    float32 and back on every vocabulary tile. An integer update is done in place on every backend."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if jnp.dtype(x.dtype).itemsize == 2 else x


def _from_storage(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _neg(acc):
    return jnp.asarray(-1e30 if acc == jnp.float32 else -1e300, acc)


def _vocab_axis(layout: str) -> int:
    """Axis of the vocabulary in a head weight of ``layout`` ("dv": ``[D, V]``, "vd": ``[V, D]``)."""
    return layout.index("v")


def _tile_logits(h_c, w_c, temperature, acc, layout: str):
    """z = (h_c @ w_c) / temperature, ``[B, c, vc]`` in ``acc`` (``h_c [B, c, D]``, ``w_c`` ``[D, vc]`` for
    layout "dv" or ``[vc, D]`` for "vd": the layout string is the weight's einsum subscript)."""
    return jnp.einsum(f"bcd,{layout}->bcv", h_c, w_c, preferred_element_type=acc).astype(acc) / temperature


def _weight_grad(h, dlogits, layout: str, acc):
    """``sum_{b,t} h[b, t] x dlogits[b, t]`` as ``[D, V]`` / ``[V, D]`` (``layout``), ``[B, T]`` merged first:
    XLA:CPU ran the two-axis contraction 1.3x slower (1.28 vs 0.99 s at T=511, V=151,936, D=1,024)."""
    n = h.shape[0] * h.shape[1]
    return jnp.einsum(f"nd,nv->{layout}", h.reshape(n, h.shape[-1]), dlogits.reshape(n, dlogits.shape[-1]),
                      preferred_element_type=acc)


def _per_token_seq_loop(t: int, c: int, names, init, step, kept=None, write=None):
    """``fori_loop`` over sequence tiles updating per-token ``[B, T]`` arrays ``init`` (named ``names``):
    ``step(k, start, old)`` gets tile k's slice of each array and returns its new values; rows of a shifted
    last tile that an earlier tile already visited keep their values. With a buffer ``kept`` (the ``[B, T, V]``
    logits being saved), ``step`` also returns the tile's logits under ``"logits"`` and ``write(kept, tile,
    start)`` stores them (all rows: a re-visited row gets its own logits again). Returns the arrays by name
    (and ``"logits"``: the filled buffer)."""
    ragged = t % c != 0
    if c == t:  # one tile, no loop; a whole-vocabulary tile is the kept logits (no zero-filled buffer to fill)
        new = step(0, 0, dict(zip(names, init)))
        if kept is not None:
            z = new.pop("logits")
            new["logits"] = z if z.shape == kept.shape else write(kept, z, 0)
        return new

    def body(k, carry):
        arrays, buf = carry
        start, row_fresh = _tile(k, c, t, ragged)
        old = {n: _slice(a, start, c, 1) for n, a in zip(names, arrays)}
        new = step(k, start, old)
        if buf is not None:
            buf = write(buf, new.pop("logits"), start)
        if row_fresh is not None:
            new = {n: jnp.where(row_fresh, new[n], old[n]) for n in names}
        return tuple(_put(a, new[n], start, 1) for n, a in zip(names, arrays)), buf

    arrays, buf = jax.lax.fori_loop(0, -(-t // c), body, (tuple(init), kept))
    return dict(zip(names, arrays), **({} if buf is None else {"logits": buf}))


def _lm_head_forward(h, w, ids, temperature, seq_chunk: int, vocab_chunk: int, with_collision: bool,
                     layout: str, keep: bool = False, with_entropy: bool = True):
    """Per-token logZ, E_p[z] (None without ``with_entropy``), sum_{v != y} p_v^2 (or None) and z[target], each
    ``[B, T]``, tile by tile, and (``keep``) the ``[B, T, V]`` logits z in the accumulation dtype, else None.

    With one vocabulary tile (``vocab_chunk == V``) each sequence tile is reduced exactly as
    ``logits_to_log_probs_and_entropy`` does (``log_z_and_mean_logit``: ``jax.nn.logsumexp``'s arithmetic),
    so the trainer's log-probs round like the sampler's. Otherwise a streaming log-sum-exp with vocabulary tiles
    outermost carries per token the running max m, s = sum exp(z - m), t = sum exp(z - m) z, q = sum_{v != y} exp(2 (z - m)) and
    z_y, so the weight is read once and no tile outlives its step. ``w`` is ``[D, V]`` (``layout`` "dv") or
    ``[V, D]`` ("vd"); the layout only chooses the axis of its vocabulary tiles and the einsum.
    """
    acc, v_axis = accumulation_dtype(h, w), _vocab_axis(layout)
    (b, t, _), v = h.shape, w.shape[v_axis]
    kept = jnp.zeros((b, t, v), acc) if keep else None

    def logits(start, w_c):
        return _tile_logits(_fenced_slice(h, start, seq_chunk, 1), w_c, temperature, acc, layout)

    if vocab_chunk == v:
        return _whole_vocab_forward(logits, w, ids, v, seq_chunk, acc, with_collision, with_entropy, kept)
    return _streaming_forward(logits, w, ids, (v, v_axis), (seq_chunk, vocab_chunk), acc, with_collision,
                              with_entropy, kept)


def _whole_vocab_forward(logits, w, ids, v: int, c: int, acc, with_collision: bool, with_entropy: bool, kept):
    """:func:`_lm_head_forward` with one vocabulary tile: each ``[B, c]`` sequence tile reduced in one step."""
    names = ("log_z",) + ("e_z",) * with_entropy + ("q",) * with_collision + ("z_y",)

    def whole_vocab(k, start, old):
        z = logits(start, w)
        log_z, e_z, probs = log_z_and_mean_logit(z, with_entropy)
        new = {"log_z": log_z, "e_z": e_z,
               "z_y": jnp.take_along_axis(z, _slice(ids, start, c, 1)[..., None], axis=-1)[..., 0]}
        if with_collision:  # sum over v != y: no cancellation against p_y^2 as p_y -> 1
            label = _slice(ids, start, c, 1)[..., None] == jnp.arange(v)
            new["q"] = jnp.sum(jnp.where(label, 0.0, probs * probs), axis=-1)
        if kept is not None:
            new["logits"] = z
        return new

    out = _per_token_seq_loop(ids.shape[1], c, names, [jnp.zeros(ids.shape, acc)] * len(names), whole_vocab, kept,
                              lambda buf, z, start: _put(buf, z, start, 1))
    return out["log_z"], out.get("e_z"), out.get("q"), out["z_y"], out.get("logits")


def _streaming_forward(logits, w, ids, vocab: tuple, chunks: tuple, acc, with_collision, with_entropy, kept):
    """:func:`_lm_head_forward` with vocabulary tiles outermost (a streaming log-sum-exp); ``vocab`` is
    ``(V, the vocabulary axis of w)``, ``chunks`` ``(seq_chunk, vocab_chunk)``."""
    (v, v_axis), (c, vc) = vocab, chunks
    t, neg, zeros = ids.shape[1], _neg(acc), jnp.zeros(ids.shape, acc)
    ragged_v = v % vc != 0
    names = ("m", "s") + ("t",) * with_entropy + ("q",) * with_collision + ("z_y",)

    def vocab_step(j, carry):
        carry, buf = carry
        vs, col_fresh = _tile(j, vc, v, ragged_v)
        w_c = _fenced_slice(w, vs, vc, v_axis)

        def streaming(k, start, old):
            z = logits(start, w_c)
            raw = z
            if col_fresh is not None:
                z = jnp.where(col_fresh, z, neg)  # stale columns: exp underflows to exactly 0
            m = jnp.maximum(old["m"], jnp.max(z, axis=-1))
            scale = jnp.exp(old["m"] - m)
            e = jnp.exp(z - m[..., None])
            new = {"m": m, "s": old["s"] * scale + jnp.sum(e, axis=-1)}
            if with_entropy:
                new["t"] = old["t"] * scale + jnp.sum(e * z, axis=-1)
            i_c = _slice(ids, start, c, 1)
            if with_collision:
                label = i_c[..., None] == vs + jnp.arange(vc)
                new["q"] = old["q"] * scale * scale + jnp.sum(jnp.where(label, 0.0, e * e), axis=-1)
            hit = (i_c >= j * vc) & (i_c < vs + vc)
            picked = jnp.take_along_axis(z, jnp.clip(i_c - vs, 0, vc - 1)[..., None], axis=-1)[..., 0]
            new["z_y"] = jnp.where(hit, picked, old["z_y"])
            if kept is not None:  # unmasked: the stale columns of a shifted tile are those columns' logits too
                new["logits"] = raw
            return new

        out = _per_token_seq_loop(t, c, names, carry, streaming, buf,
                                  lambda buf, z, start: jax.lax.dynamic_update_slice(buf, z, (0, start, vs)))
        return tuple(out[n] for n in names), out.get("logits")

    init = tuple(jnp.full(ids.shape, neg, acc) if n == "m" else zeros for n in names)
    arrays, kept = jax.lax.fori_loop(0, -(-v // vc), vocab_step, (init, kept))
    out = dict(zip(names, arrays))
    log_z = out["m"] + jnp.log(out["s"])
    collision = out["q"] / (out["s"] * out["s"]) if with_collision else None
    e_z = out["t"] / out["s"] if with_entropy else None
    return log_z, e_z, collision, out["z_y"], kept


def _stats_outputs(log_z, e_z, collision, z_y) -> tuple:
    """``(log_probs[, entropy][, collision_others])``: entropy when ``e_z`` was computed, C' when requested."""
    return (z_y - log_z,) + (() if e_z is None else (log_z - e_z,)) + (() if collision is None else (collision,))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _lm_head_stats(h, w, ids, temperature, seq_chunk, vocab_chunk, bwd_vocab_chunk, with_collision, keep, layout,
                   with_entropy):
    """``(log_probs[, entropy][, C'])`` ``[B, T]`` (``chunked_log_probs_and_entropy``); keeps no logits."""
    log_z, e_z, collision, z_y, _ = _lm_head_forward(h, w, ids, temperature, seq_chunk, vocab_chunk, with_collision,
                                                     layout, False, with_entropy)
    return _stats_outputs(log_z, e_z, collision, z_y)


def _lm_head_stats_fwd(h, w, ids, temperature, seq_chunk, vocab_chunk, bwd_vocab_chunk, with_collision, keep,
                       layout, with_entropy):
    log_z, e_z, collision, z_y, kept = _lm_head_forward(h, w, ids, temperature, seq_chunk, vocab_chunk,
                                                        with_collision, layout, keep, with_entropy)
    outs = _stats_outputs(log_z, e_z, collision, z_y)
    return outs, (h, w, ids, temperature, log_z, e_z, collision, kept)  # (keep) the [B, T, V] logits


def _logits_cotangent(z, onehot, lz, ez, glp, gh, cc=None, gc=None):
    """d loss / d z for logits ``z`` (any shape ``[..., V]``; the per-token arguments broadcast against it):
    ``glp (1[v = y] - p) - gh p (z - E) (+ 2 gc p (p 1[v != y] - C'))`` with ``p = exp(z - lz)`` (no entropy
    term when ``gh`` is None)."""
    p = jnp.exp(z - lz)
    dz = glp * (onehot - p)
    if gh is not None:
        dz = dz - gh * p * (z - ez)
    if gc is not None:
        dz = dz + 2.0 * gc * p * (jnp.where(onehot, 0.0, p) - cc)
    return dz


def _kept_logits_backward(h, w, ids, temperature, log_z, e_z, collision, kept, g_lp, g_h, g_c, layout, seq_chunk):
    """The backward when the forward kept the ``[B, T, V]`` logits and every operand is in the accumulation
    dtype: no vocabulary tiles. ``d logits = dz / temperature`` overwrites the kept logits in place,
    ``seq_chunk`` rows at a time (so no second ``[B, T, V]`` buffer exists), without its label term, which is
    then added at the ``B * T`` label positions (a scatter-add: no ``[B, T, V]`` one-hot); one ``[B, T, V] x W``
    matmul gives dh and one gives dw, written straight into a result of the weight's layout. bf16 operands take
    the tiled backward instead (on CPU a whole-vocabulary matmul against them would upcast the whole weight).
    At T=511, V=151,936, D=1,024 on 2 CPU cores about 1.8x faster than the vocabulary-tiled loop.

    With ``p = exp(z - lz)`` the cotangent of ``_logits_cotangent`` splits into
    ``-p (glp + gh (z - E)) (+ 2 gc p (p 1[v != y] - C'))`` on every entry and ``glp`` at the label. The collision
    term keeps its label mask (one compare per entry, only ``with_collision``): split into ``2 gc p (p - C')``
    everywhere and ``- 2 gc p_y^2`` at the label, it would be the difference of two O(1) terms as ``p_y -> 1``
    and lose all the relative precision of its true value ``- 2 gc p_y C'``.

    ``d temperature = -sum(dz z) / temperature = -sum(h . dh) / temperature`` (``z = h W / temperature`` and
    ``dh = dz W^T / temperature``): a ``[B, T, D]`` reduction after the loop. Reading the logits for it inside
    the loop (or ``z_y`` from them after it) keeps the buffer being overwritten live, and XLA then copies the
    whole ``[B, T, V]`` buffer (on CPU twice per tile)."""
    acc = kept.dtype
    b, t, v = kept.shape
    c = min(seq_chunk, t)
    ragged = t % c != 0
    g_lp = g_lp.astype(acc)
    ent = () if g_h is None else (e_z, g_h.astype(acc))
    per_token = (log_z, g_lp) + ent + (() if g_c is None else (ids, collision, g_c.astype(acc)))

    def body(k, buf):
        start, row_fresh = _tile(k, c, t, ragged)
        z = _slice(buf, start, c, 1)
        lz, glp, *rest = (_slice(a, start, c, 1)[..., None] for a in per_token)
        (ez, gh), coll = (rest[:2], rest[2:]) if ent else ((None, None), rest)
        p = jnp.exp(z - lz)
        dz = -p * (glp if gh is None else glp + gh * (z - ez))
        if coll:
            i_c, cc, gc = coll
            dz = dz + 2.0 * gc * p * (jnp.where(i_c == jnp.arange(v), 0.0, p) - cc)
        dlogits = dz / temperature
        if row_fresh is not None:  # rows an earlier tile visited already hold their d logits
            dlogits = jnp.where(row_fresh[:, None], dlogits, z)
        return _put(buf, dlogits, start, 1)

    dlogits = body(0, kept) if c == t else jax.lax.fori_loop(0, -(-t // c), body, kept)
    rows = jnp.arange(b)[:, None]
    dlogits = dlogits.at[rows, jnp.arange(t)[None, :], ids].add(g_lp / temperature, unique_indices=True)
    dh = jnp.einsum(f"btv,{layout}->btd", dlogits, w, preferred_element_type=acc)
    dw = _weight_grad(h, dlogits, layout, acc)
    dtemp = -jnp.sum(h * dh) / temperature
    return dh.astype(h.dtype), dw.astype(w.dtype), None, dtemp.astype(temperature.dtype)


def _lm_head_stats_bwd(seq_chunk, _, vocab_chunk, with_collision, keep, layout, with_entropy, res, cts):
    """Hand-written backward over the same tiles, reading each logits tile from the kept logits (``keep``) or
    recomputing it once.

    With p = softmax(z), E = E_p[z], C' = sum_{v != y} p_v^2 and cotangents (g_lp, g_H, g_C') per token:
      dz_v = g_lp (1[v = y] - p_v) - g_H p_v (z_v - E) + 2 g_C' p_v (p_v 1[v != y] - C')
    then d logits = dz / temperature, dh = d logits @ w^T, dw = h^T @ d logits, d temperature = -sum dz z / T.
    Vocabulary tiles (``bwd_vocab_chunk`` wide) are outermost, so the float32 head-gradient accumulator is one tile
    (written once into the result, ``[D, V]`` or ``[V, D]`` as ``layout`` says, in the weight's dtype) while dh
    ``[B, T, D]`` (small) accumulates.
    """
    h, w, ids, temperature, log_z, e_z, collision, kept = res
    g_lp = cts[0]
    g_h = cts[1] if with_entropy else None
    g_c = cts[-1] if with_collision else None
    acc = accumulation_dtype(h, w)
    if keep and h.dtype == acc and w.dtype == acc:
        return _kept_logits_backward(h, w, ids, temperature, log_z, e_z, collision, kept, g_lp, g_h, g_c, layout,
                                     seq_chunk)
    _, t, d = h.shape
    v_axis = _vocab_axis(layout)
    v = w.shape[v_axis]
    c, vc = seq_chunk, vocab_chunk
    ragged_t, ragged_v = t % c != 0, v % vc != 0
    ent = (e_z, g_h.astype(acc)) if with_entropy else ()
    per_token = (ids, log_z, g_lp.astype(acc)) + ent + ((collision, g_c.astype(acc)) if with_collision else ())
    n_v = -(-v // vc)

    def vocab_step(i, carry):
        # last tile first: when it is shifted back (ragged V), its stale columns are written as zeros and then
        # overwritten by the previous tile, so dw is only ever written, never read (XLA updates it in place)
        j = n_v - 1 - i
        dh, dw, dtemp = carry
        vs, col_fresh = _tile(j, vc, v, ragged_v)
        w_c = _fenced_slice(w, vs, vc, v_axis)

        def seq_step(k, carry):
            dh, dw_c, dtemp = carry
            ss, row_fresh = _tile(k, c, t, ragged_t)
            h_c = _fenced_slice(h, ss, c, 1)
            i_c, lz, glp, *rest = (_slice(a, ss, c, 1)[..., None] for a in per_token)
            (ez, gh), coll = (rest[:2], rest[2:]) if with_entropy else ((None, None), rest)
            if keep:
                z = jax.lax.dynamic_slice(kept, (0, ss, vs), (kept.shape[0], c, vc))
            else:
                z = _tile_logits(h_c, w_c, temperature, acc, layout)
            dz = _logits_cotangent(z, i_c == vs + jnp.arange(vc), lz, ez, glp, gh, *coll)
            if col_fresh is not None or row_fresh is not None:
                fresh = jnp.ones((c, vc), bool)
                fresh = fresh if col_fresh is None else fresh & col_fresh
                fresh = fresh if row_fresh is None else fresh & row_fresh[:, None]
                dz = jnp.where(fresh, dz, 0.0)
            dtemp = dtemp - jnp.sum(dz * z) / temperature
            dlogits = dz / temperature
            dh_c = jnp.einsum(f"bcv,{layout}->bcd", dlogits, w_c, preferred_element_type=acc)
            dh = _put(dh, _slice(dh, ss, c, 1) + dh_c, ss, 1)
            dw_c = dw_c + _weight_grad(h_c, dlogits, layout, acc)
            return dh, dw_c, dtemp

        dw_c = jnp.zeros((vc, d) if layout == "vd" else (d, vc), acc)
        dh, dw_c, dtemp = jax.lax.fori_loop(0, -(-t // c), seq_step, (dh, dw_c, dtemp))
        return dh, _put(dw, _to_storage(dw_c.astype(w.dtype)), vs, v_axis), dtemp

    init = (jnp.zeros(h.shape, acc), _to_storage(jnp.zeros(w.shape, w.dtype)), jnp.zeros((), acc))
    dh, dw, dtemp = jax.lax.fori_loop(0, n_v, vocab_step, init)
    return dh.astype(h.dtype), _from_storage(dw, w.dtype), None, dtemp.astype(temperature.dtype)


_lm_head_stats.defvjp(_lm_head_stats_fwd, _lm_head_stats_bwd)


def chunked_log_probs_and_entropy(
    hidden: jax.Array,
    lm_head_weight: jax.Array,
    token_ids: jax.Array,
    *,
    temperature: float = 1.0,
    seq_chunk: int = 512,
    vocab_chunk: int | None = None,
    with_collision: bool = False,
    max_saved_logits_bytes: int | None = None,
    weight_layout: str = "dv",
    calculate_entropy: bool = True,
) -> tuple[jax.Array, ...]:
    """Per-token log-probability and entropy from hidden states; ``[B, T, V]`` logits exist only within a budget.

    ``logits[b, t] = hidden[b, t] @ W`` (accumulated in float32; ``W = lm_head_weight`` for ``weight_layout``
    "dv", ``lm_head_weight.T`` for "vd"), divided by ``temperature``;
    ``log_probs[b, t] = log softmax(logits[b, t])[token_ids[b, t]]`` and
    ``entropy[b, t] = logsumexp(logits[b, t]) - E_softmax[logits[b, t]]``, identical (to float rounding)
    to ``logits_to_log_probs_and_entropy(hidden @ W, token_ids, temperature)``.

    The logits are visited in tiles of ``seq_chunk`` positions x ``vocab_chunk`` vocabulary entries (vocabulary
    tiles outermost, sequence tiles inside, ``lax.fori_loop``), keeping per token a running max, sum of
    exponentials, their z-weighted sum (and sum of squares of the other tokens' probabilities), so the largest
    buffer is one ``[B, seq_chunk, vocab_chunk]`` tile (and the logits when they are kept, below). The backward
    is hand-written (``jax.custom_vjp``): it saves the inputs and logZ, E_p[z] (and C') per token, and the
    float32 logits only when they fit ``max_saved_logits_bytes``; it reads (or else recomputes) each tile once,
    accumulates the hidden-state gradient in float32 ``[B, T, D]`` and the head-weight gradient one float32
    vocabulary tile at a time, written into a result of the weight's own shape, layout and dtype. (Kept logits
    with float32/float64 ``hidden`` and weight: the d logits overwrite the kept logits in place and two whole
    matmuls give dh and dw.) A tied head passes the embedding as stored (``[V, D]``, ``weight_layout="vd"``):
    its tiles are row slices and its gradient is ``[V, D]``, so no transposed copy of the weight or of its
    gradient exists (as Tunix's ``x @ embedding.T``). Gradients w.r.t. ``hidden``, ``lm_head_weight`` and
    ``temperature`` are exact (to float rounding); forward-mode differentiation is not supported. Neither chunk
    needs to divide its axis: the last tile is shifted back to end at the axis end and its already-visited part
    is ignored, so no operand is padded or copied.

    Args:
      hidden: ``[B, T, D]`` float (bf16/f32/f64), the model's final-norm hidden states at the positions that
        predict ``token_ids`` (i.e. already shifted by the caller).
      lm_head_weight: float, ``[D, V]`` (``weight_layout`` "dv", an untied ``lm_head`` kernel) or ``[V, D]``
        ("vd", the embedding of a tied model); ``Qwen3.lm_head_weight_and_layout`` returns both.
      token_ids: ``[B, T]`` integer ids of the tokens whose probability is wanted.
      temperature: positive float, the sampling temperature.
      seq_chunk: positive int, sequence positions per tile (capped at T).
      vocab_chunk: positive int or None, vocabulary entries per tile (capped at V). None: the forward takes the
        whole vocabulary per tile (one ``[B, seq_chunk, V]`` tile) and the backward tiles it at
        ``BACKWARD_VOCAB_CHUNK`` (8192) entries, so its float32 head-gradient accumulator never is ``[D, V]``.
      with_collision: also return the collision probability of the *other* tokens
        ``C' = sum_{v != y} softmax(z)_v^2`` ``[B, T]``, summed without the sampled token so that it keeps its
        relative precision as ``p_y -> 1`` (the collision probability is ``C = C' + exp(2 log_probs)``; the Lemma
        A.1 gradient norm is ``(1 - p)^2 + C'``, ``stapo_jax.algo.diagnostics.gradient_norm_sq``).
      max_saved_logits_bytes: int >= 0 or None (``SAVED_LOGITS_BYTES``, 512 MiB). When differentiated and the
        logits take ``B * T * V * 4`` bytes (8 for float64) or fewer, the forward keeps them and the backward
        does no recomputation (2 head matmuls per tile instead of 3); above it the backward recomputes each tile.
        0: always recompute. Same values and gradients either way (to float rounding).
      weight_layout: "dv" or "vd", the layout of ``lm_head_weight`` (above; the gradient has it too).
      calculate_entropy: False skips the entropy (verl ``calculate_entropy``: no ``E_p[z]`` pass, no entropy
        term in the backward); the entropy slot of the result is then None. Same log-probs and gradients.

    Returns:
      ``(log_probs, entropy)`` (or ``(log_probs, entropy, collision_others)``), each ``[B, T]`` float32
      (float64 for float64 inputs); log-probs and entropy in nats; entropy None without ``calculate_entropy``.

    Raises:
      ValueError: on rank/shape mismatches (naming the argument), an unknown ``weight_layout``, non-integer
        ``token_ids``, non-positive ``seq_chunk`` / ``vocab_chunk`` / ``temperature``, or a negative
        ``max_saved_logits_bytes``.

    Source: conventions.md §5 (EasyDeL streaming log-sum-exp; Tunix ``compute_chunked_logps``); the entropy
    identity is verl ``entropy_from_logits``.
    """
    check_temperature(temperature)
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, D], got shape {tuple(hidden.shape)}")
    if weight_layout not in ("dv", "vd"):
        raise ValueError(f"weight_layout must be 'dv' ([D, V]) or 'vd' ([V, D]), got {weight_layout!r}")
    d_axis = weight_layout.index("d")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[d_axis] != hidden.shape[-1]:
        raise ValueError(f"lm_head_weight must be {'[D, V]' if weight_layout == 'dv' else '[V, D]'} (weight_layout="
                         f"{weight_layout!r}) with D = hidden.shape[-1] = {hidden.shape[-1]}, got shape "
                         f"{tuple(lm_head_weight.shape)}")
    if tuple(token_ids.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} must equal hidden.shape[:2] = {hidden.shape[:2]}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be an integer array, got dtype {token_ids.dtype}")
    if int(seq_chunk) <= 0:
        raise ValueError(f"seq_chunk must be > 0, got {seq_chunk}")
    if vocab_chunk is not None and int(vocab_chunk) <= 0:
        raise ValueError(f"vocab_chunk must be > 0 or None, got {vocab_chunk}")
    budget = SAVED_LOGITS_BYTES if max_saved_logits_bytes is None else int(max_saved_logits_bytes)
    if budget < 0:
        raise ValueError(f"max_saved_logits_bytes must be >= 0 or None, got {max_saved_logits_bytes}")

    acc = accumulation_dtype(hidden, lm_head_weight)
    b, t, v = hidden.shape[0], hidden.shape[1], lm_head_weight.shape[1 - d_axis]
    if t == 0:
        empty = jnp.zeros((b, 0), acc)
        return (empty, empty if calculate_entropy else None) + ((empty,) if with_collision else ())
    c = min(int(seq_chunk), t)
    vc = v if vocab_chunk is None else min(int(vocab_chunk), v)
    vc_bwd = min(BACKWARD_VOCAB_CHUNK if vocab_chunk is None else int(vocab_chunk), v)
    keep = b * t * v * jnp.dtype(acc).itemsize <= budget
    temp = jnp.asarray(temperature, acc)
    outs = _lm_head_stats(hidden, lm_head_weight, token_ids.astype(jnp.int32), temp, c, vc, vc_bwd,
                          bool(with_collision), bool(keep), weight_layout, bool(calculate_entropy))
    return outs if calculate_entropy else (outs[0], None) + outs[1:]
