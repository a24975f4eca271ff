"""Padding-free micro-batches: the sequences of a ``[B, P + R]`` batch packed into fixed-length rows.

verl's ``use_remove_padding`` (packed variable-length flash attention) in fixed shapes for XLA: the real tokens
of each sequence (prompt + response, ``attention_mask == 1``, in order) are laid end to end into rows of
``row_length`` tokens by first-fit decreasing; each sequence gets its own segment id (1, 2, ... per row; 0 =
padding) so attention never crosses sequences (``models.attention``), and its own RoPE positions 0, 1, ...
(the padded batch's ``max(cumsum(mask) - 1, 0)``), so every real token sees exactly the keys and positions it
sees in the padded batch. As verl's rmpad log-prob path, the LM head then runs on the packed positions
(``stapo_jax.train.policy``): each position's target is the next packed token (:attr:`PackedLayout.next_token_ids`),
and ``response_index`` maps each response column ``(b, r)`` of the ``[B, R]`` layout (``stapo_jax.train.batching``)
to the packed position that predicts it, so :func:`gather_response_values` moves the per-token log-probs and
entropies (scalars) back to ``[B, R]``; token masks, the S2T quantile population, every aggregation mode and the
metrics keep the padded batch's ``[B, R]`` arrays, while the transformer and the LM head compute only the packed
rows (``M * L`` positions, not slots x R).

Sharding: with ``num_shards = S`` the B rows are split into S contiguous blocks (the data-parallel shards of a
row-sharded batch) and each block is packed into its own ``M / S`` rows; ``response_index`` is local to the
block, and :func:`gather_response_values` is a gather batched over the S blocks, so a batch sharded over S
devices packs and gathers on each device without communication.
"""
from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class PackedLayout:
    """Packed rows of one micro-batch and the map back to its ``[B, R]`` response layout.

    Fields:
      input_ids: [M, L] int32 packed token ids (0 in padding).
      segment_ids: [M, L] int32, 1, 2, ... per sequence within a row, 0 on padding.
      positions: [M, L] int32 RoPE positions, restarting at 0 for each sequence.
      response_index: [B, R] int32, flat index ``row * L + column`` within the row's shard block (see the
        module docstring) of the hidden state that predicts response token ``(b, r)``; 0 on response padding.
      num_shards: (static) the ``num_shards`` the rows were planned with.
    """

    input_ids: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    response_index: jax.Array
    num_shards: int = flax.struct.field(pytree_node=False, default=1)

    @property
    def attention_mask(self) -> jax.Array:
        """[M, L] bool, True on packed real tokens."""
        return self.segment_ids > 0

    @property
    def next_token_ids(self) -> jax.Array:
        """[M, L] int32, the packed token after each position in its row (0 after the last column): the LM-head
        target of every packed position. At the position ``response_index[b, r]`` it is response token
        ``(b, r)`` (a sequence's real tokens are contiguous in its row); elsewhere (prompt, a sequence's last
        token, padding) the value is computed and never gathered. Source: verl rmpad log-probs
        (``torch.roll(input_ids_rmpad, shifts=-1)``)."""
        ids = self.input_ids
        return jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], axis=1)


def first_fit_decreasing(lengths: np.ndarray, row_length: int) -> list[list[int]]:
    """Bin packing of sequences into rows (first-fit decreasing, ties in index order).

    Args: lengths [n] int (tokens per sequence, each <= ``row_length``); row_length (tokens per row).
    Returns: the sequence indices of each row, in placement order (rows in creation order). Never raises (a
    sequence longer than ``row_length`` gets a row of its own; callers check lengths first).
    Source: the classic first-fit-decreasing bin-packing heuristic (Johnson, 1973).
    """
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = next((j for j, f in enumerate(free) if f >= lengths[i]), None)
        if j is None:
            rows.append([])
            free.append(int(row_length))
            j = len(rows) - 1
        rows[j].append(i)
        free[j] -= int(lengths[i])
    return rows


def pack_sequences(input_ids: np.ndarray, attention_mask: np.ndarray, response_length: int, row_length: int, *,
                   num_shards: int = 1, row_multiple: int = 1, num_rows: Optional[int] = None) -> PackedLayout:
    """Plan (on the host, numpy) the packed rows of a ``[B, P + R]`` batch.

    Args:
      input_ids: [B, T] int token ids; attention_mask: [B, T] bool/int (1 on real tokens; a sequence's real
        tokens are its prompt then its response, as ``stapo_jax.train.batching.pack_prompt_response`` lays them out).
      response_length: R, the response columns at the end of the padded rows (``T - R`` = P).
      row_length: L, tokens per packed row (>= the longest sequence).
      num_shards: S, contiguous row blocks packed separately (B and the row count divisible by S).
      row_multiple: rows per shard are rounded up to a multiple of this (fewer distinct compiled shapes).
      num_rows: total packed rows M (fixed shape); default: as many as first-fit decreasing needs, rounded.
    Returns:
      :class:`PackedLayout` of numpy arrays (put them on device with the batch).
    Raises:
      ValueError: shapes that disagree, ``B % num_shards``, a sequence longer than ``row_length`` (names it),
        a response token whose predicting position is not a real token, or more rows needed than ``num_rows``.
    """
    ids = np.asarray(input_ids)
    mask = np.asarray(attention_mask).astype(bool)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids {ids.shape} and attention_mask {mask.shape} must both be [B, T]")
    b, t = ids.shape
    r = int(response_length)
    if not 1 <= r < t or row_length < 1 or num_shards < 1 or row_multiple < 1 or b % num_shards:
        raise ValueError(f"pack_sequences: response_length={r} must be in [1, {t - 1}], row_length={row_length}, "
                         f"row_multiple={row_multiple} >= 1 and num_shards={num_shards} must divide B={b}")
    lengths = mask.sum(1)
    if lengths.max() > row_length:
        i = int(np.argmax(lengths))
        raise ValueError(f"sequence {i} has {lengths[i]} tokens > packing row_length {row_length}")
    per = b // num_shards
    blocks = [[[s * per + i for i in row] for row in first_fit_decreasing(lengths[s * per:(s + 1) * per], row_length)]
              for s in range(num_shards)]
    m_shard = -(-max(len(rows) for rows in blocks) // row_multiple) * row_multiple
    if num_rows is not None:
        if num_rows % num_shards or num_rows // num_shards < m_shard:
            raise ValueError(f"packing needs {m_shard} rows per shard x {num_shards} shards; num_rows={num_rows}")
        m_shard = num_rows // num_shards
    m = m_shard * num_shards
    out_ids = np.zeros((m, row_length), np.int32)
    seg = np.zeros((m, row_length), np.int32)
    pos = np.zeros((m, row_length), np.int32)
    resp_index = np.zeros((b, r), np.int32)
    p = t - r
    for s, rows in enumerate(blocks):
        for j, members in enumerate(rows):
            row, off = s * m_shard + j, 0
            for k, i in enumerate(members):
                cols = np.flatnonzero(mask[i])
                n = len(cols)
                out_ids[row, off:off + n] = ids[i, cols]
                seg[row, off:off + n] = k + 1
                pos[row, off:off + n] = np.arange(n)
                rank = np.cumsum(mask[i]) - 1   # padded column -> index among the sequence's real tokens
                rc = np.flatnonzero(mask[i, p:])
                if not mask[i, p + rc - 1].all():
                    raise ValueError(f"sequence {i}: a response token follows a padding position (the hidden "
                                     f"state that predicts it is not a real token)")
                resp_index[i, rc] = j * row_length + off + rank[p + rc - 1]
                off += n
    return PackedLayout(input_ids=out_ids, segment_ids=seg, positions=pos, response_index=resp_index,
                        num_shards=num_shards)


def tokens_bucket(n: int) -> int:
    """Packed row length for ``n`` tokens, rounded up to a bucket: a multiple of ``max(8, 2 ** (bit_length - 5))``
    (16 buckets per octave, < 6.25% extra tokens), so a jitted step recompiles only when the bucket changes.
    ``n``: tokens (int); returns tokens (int >= 8); never raises. Source: this project's buckets
    (bench/bench_packing.py), in the spirit of verl's padded bucket sizes."""
    n = max(int(n), 1)
    step = 1 << max(n.bit_length() - 5, 3)
    return -(-n // step) * step


def micro_batch_rows(blocks: list[np.ndarray], width: int, long_rows: bool = True) -> tuple[int, int]:
    """The packed geometry shared by every micro-batch (one compiled shape): ``(M, L)`` = M rows of L tokens per
    shard block, as few tokens ``M * L`` as first-fit decreasing allows.

    Rows of at most the padded width ``P + R``: M starts at ``ceil(fullest / width)`` and L is the smallest
    :func:`tokens_bucket` >= the longest sequence and >= fullest / M into which every block fits (M grows by one
    when none up to ``width`` does). ``long_rows`` (an attention that skips key blocks outside each query's
    segment, ``models.attention`` ``blockwise``) also allows one row per block of the fullest block's bucketed
    tokens (verl's flat varlen row), longer than ``P + R``, and takes whichever computes fewer tokens: the cost
    then follows the real tokens whatever the longest sequence. Kernels whose cost grows with L^2 however the
    row is segmented (xla, cudnn, splash) keep ``long_rows`` false.

    Args: blocks: per (micro-batch, shard) block, the [n] int token counts of its sequences; width: the padded
    width P + R; long_rows: as above. Returns: (M, L). Raises: ValueError: a sequence longer than ``width``.
    """
    longest = max(int(x.max()) if len(x) else 0 for x in blocks)
    fullest = max(int(x.sum()) for x in blocks)
    if longest > width:
        raise ValueError(f"a sequence has {longest} tokens > the padded width {width}")
    m = max(-(-fullest // width), 1)
    best = None
    while best is None:
        L = min(tokens_bucket(max(longest, -(-fullest // m))), width)
        while True:
            if all(len(first_fit_decreasing(x, L)) <= m for x in blocks):
                best = (m, L)
                break
            if L >= width:
                break
            L = min(tokens_bucket(L + 1), width)
        m += 1
    flat = tokens_bucket(fullest)
    return (1, flat) if long_rows and flat < best[0] * best[1] else best


def fixed_geometries(per_block: int, width: int, long_rows: bool = True) -> list[tuple[int, int]]:
    """The bounded set of packed geometries ``(M, L)`` of ``trainer.precompile`` (at most 3, so at most 3 compiled
    update programs and 3 old-log-prob programs per micro-batch count), smallest first: a quarter, a half and all
    of the padded micro-batch block's tokens ``per_block * width`` -- rows of ``width`` = P + R tokens, or, with
    ``long_rows``, one row of that many tokens. The last always holds any block (one sequence per row).
    Ints in, a list of (rows, tokens per row) int pairs out; raises ValueError for sizes < 1. Source: this project's
    bounded shapes (issue 33), in the spirit of JetStream's fixed padding buckets."""
    if per_block < 1 or width < 1:
        raise ValueError(f"fixed_geometries: per_block={per_block} and width={width} must be >= 1")
    if long_rows:
        sizes = [tokens_bucket(-(-per_block * width // q)) for q in (4, 2)] + [per_block * width]
        return sorted({(1, min(x, per_block * width)) for x in sizes}, key=lambda g: g[1])
    return sorted({(-(-per_block // q), width) for q in (4, 2, 1)})


def fit_geometry(blocks: list[np.ndarray], geometries: list[tuple[int, int]]) -> tuple[int, int]:
    """The first ``(M, L)`` of ``geometries`` into which first-fit decreasing packs every block (the [n] int token
    counts of its sequences) in at most M rows of L tokens. Raises ValueError when none does (names the
    fullest block). Source: :func:`fixed_geometries`."""
    for m, L in geometries:
        if all(len(first_fit_decreasing(x, L)) <= m for x in blocks) and \
                max((int(x.max()) if len(x) else 0) for x in blocks) <= L:
            return m, L
    raise ValueError(f"no packed geometry of {geometries} holds a block of {max(int(x.sum()) for x in blocks)} "
                     f"tokens")


def pack_micro_batches(input_ids: np.ndarray, attention_mask: np.ndarray, response_length: int, *,
                       num_micro_batches: int, num_shards: int = 1, long_rows: bool = True,
                       geometries: Optional[list[tuple[int, int]]] = None) -> PackedLayout:
    """Packed layouts of the K micro-batches of one ``[B, P + R]`` mini-batch, in one :class:`PackedLayout` that
    the train step splits like the rest of its ``Batch`` (``stapo_jax.train.train_step``: micro-batch ``j`` =
    rows ``j, j + K, ...``).

    Every micro-batch and shard block is packed with :func:`pack_sequences` into the same M rows of L tokens
    (:func:`micro_batch_rows`), so the transformer computes about the real tokens of the fullest block per
    micro-batch (with ``balanced_row_order``, about the mean). With ``long_rows`` that is one row of the block's
    bucketed token count, which may be longer than ``P + R``; attention on it stays per sequence because the
    blockwise kernel skips key blocks outside a query block's segments (``models.attention.block_ranges``).
    Without, rows are at most ``P + R`` tokens (for kernels whose cost is quadratic in the row length).

    Args:
      input_ids, attention_mask: [B, P + R] (numpy, the ``stapo_jax.train.batching`` layout).
      response_length: R. num_micro_batches: K (divides B). num_shards: S, data-parallel shards (divides B / K).
      long_rows: see :func:`micro_batch_rows` (``packing_long_rows`` says which attention allows it).
      geometries: a bounded set of ``(M, L)`` (:func:`fixed_geometries`): the first that holds every block is
        used instead of the tightest one (:func:`fit_geometry`); None: the tightest (:func:`micro_batch_rows`).
    Returns:
      :class:`PackedLayout` with ``input_ids`` / ``segment_ids`` / ``positions`` [K * S * M, L] int32, interleaved
      so that rows ``j, j + K, ...`` are micro-batch ``j``'s S * M packed rows (shard-local under a row sharding),
      ``response_index`` [B, R] int32 (row b's index into micro-batch ``b % K``'s rows of its shard block).
    Raises:
      ValueError: K or S not dividing the rows, or as :func:`pack_sequences`.
    """
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    b, t = ids.shape
    k = int(num_micro_batches)
    if k < 1 or b % k or (b // k) % num_shards:
        raise ValueError(f"pack_micro_batches: num_micro_batches={k} x num_shards={num_shards} must divide the "
                         f"batch size {b}")
    lengths = mask.astype(bool).sum(1)
    per = b // k // num_shards
    blocks = [lengths[j::k][s * per:(s + 1) * per] for j in range(k) for s in range(num_shards)]
    m, L = micro_batch_rows(blocks, t, long_rows) if geometries is None else fit_geometry(blocks, geometries)
    lays = [pack_sequences(ids[j::k], mask[j::k], response_length, L, num_shards=num_shards,
                           num_rows=num_shards * m) for j in range(k)]

    def interleave(name):  # micro-batch j's row i -> global row i * K + j (train_step's strided split)
        return np.stack([getattr(lay, name) for lay in lays], 1).reshape(num_shards * m * k, L)

    resp = np.zeros((b, response_length), np.int32)
    for j, lay in enumerate(lays):
        resp[j::k] = lay.response_index
    return PackedLayout(input_ids=interleave("input_ids"), segment_ids=interleave("segment_ids"),
                        positions=interleave("positions"), response_index=resp, num_shards=num_shards)


def packing_long_rows(attention: str) -> bool:
    """True when packed rows may be longer than the padded width: the resolved ``model.attention`` (after
    ``models.attention.resolve_implementation``) is ``blockwise``, whose cost follows the segments; xla, cudnn
    and splash compute the whole causal L x L square of a row. Takes a str, returns a
    bool. Never raises. Source: verl ``use_remove_padding`` (one flat varlen row per micro-batch)."""
    return attention == "blockwise"


def gather_response_values(values: jax.Array, response_index: jax.Array, num_shards: int = 1) -> jax.Array:
    """Per-position values of packed rows (log-probs, entropies, hidden states) in the ``[B, R]`` response layout.

    Args:
      values: [M, L, ...] (any dtype), one value (a scalar, or a trailing-shaped array such as a ``[D]`` hidden
        state) per packed position of :class:`PackedLayout` rows.
      response_index: [B, R] int32 from :func:`pack_sequences` (local to each of the ``num_shards`` blocks).
      num_shards: the ``num_shards`` the layout was planned with.
    Returns:
      [B, R, ...] in values' dtype: ``out[b, r] = values`` at block ``b // (B / S)``'s flat position
      ``response_index[b, r]``, a gather batched over the shard blocks (each block reads only its rows; the
      VJP is a scatter-add into ``[M, L, ...]``, zero at positions no response column reads).
    Raises:
      ValueError: M or B not divisible by ``num_shards``, or values of rank < 2.
    Source: verl ``use_remove_padding`` (log-probs computed on the packed tokens, then ``pad_input`` back).
    """
    if values.ndim < 2:
        raise ValueError(f"values must be [M, L, ...] (one value per packed position), got shape "
                         f"{tuple(values.shape)}")
    m, l, rest = values.shape[0], values.shape[1], tuple(values.shape[2:])
    b, r = response_index.shape
    if m % num_shards or b % num_shards:
        raise ValueError(f"packed rows {m} and batch rows {b} must be divisible by num_shards={num_shards}")
    v = values.reshape(num_shards, (m // num_shards) * l, *rest)
    idx = response_index.reshape(num_shards, (b // num_shards) * r)
    return jax.vmap(lambda vs, i: jnp.take(vs, i, axis=0))(v, idx).reshape(b, r, *rest)


def check_split(who: str, lengths: np.ndarray, mini_rows: int, num_micro_batches: int,
                num_shards: int) -> tuple[int, int]:
    """``(B, K)`` after checking that B rows split into mini-batches of ``mini_rows``, each into K micro-batches x
    ``num_shards`` shard blocks. ``lengths``: [B] int (only its length is read). Raises: ValueError naming
    ``who`` and the sizes when one does not divide the next. Source: verl's ``ppo_mini_batch_size`` /
    micro-batch split (each must divide the next)."""
    b, k = lengths.shape[0], int(num_micro_batches)
    if mini_rows < 1 or b % mini_rows or k < 1 or mini_rows % (k * num_shards):
        raise ValueError(f"{who}: {b} rows in mini-batches of {mini_rows} with num_micro_batches={k} x "
                         f"num_shards={num_shards}: each must divide the next")
    return b, k


def balanced_row_order(lengths: np.ndarray, *, mini_rows: int, num_micro_batches: int,
                       num_shards: int = 1) -> np.ndarray:
    """A row permutation that gives the K micro-batches of every mini-batch (and of every data-parallel shard
    block in it) nearly equal token counts, so that :func:`pack_micro_batches`, which gives every micro-batch the
    row count of the fullest one, computes few padding rows. verl balances its dynamic micro-batches the same
    way (``rearrange_micro_batches``: sequences sorted by length, each to the lightest micro-batch).

    Rows never leave their mini-batch or their shard block (``mini_rows / num_shards`` contiguous rows); inside a
    block, rows are taken longest first, each to the micro-batch with the fewest tokens that still has room, and
    micro-batch ``j``'s rows are placed at local positions ``j, j + K, ...`` (the train step's strided split).
    Only for updates whose result does not depend on which micro-batch a row is in (the trainer uses it with no
    mask or a ``minibatch``-scoped S2T / 20-Entropy mask; per-micro-batch populations and the random Clip-Cov /
    KL-Cov selections would change).

    Args:
      lengths: [B] int, tokens per row (e.g. ``attention_mask.sum(-1)``); B a multiple of ``mini_rows``.
      mini_rows, num_micro_batches, num_shards: mini-batch rows, K, S (K x S divides ``mini_rows``).
    Returns:
      [B] int64 permutation ``perm``: the update reads row ``perm[i]`` at position ``i``.
    Raises:
      ValueError: B not a multiple of ``mini_rows`` or K x S not dividing ``mini_rows``.
    """
    lengths = np.asarray(lengths)
    b, k = check_split("balanced_row_order", lengths, mini_rows, num_micro_batches, num_shards)
    n = mini_rows // num_shards
    perm = np.empty(b, np.int64)
    for start in range(0, b, n):  # one shard block of one mini-batch
        for j, members in enumerate(lightest_first_groups(lengths[start:start + n], k, n // k)):
            perm[start + j:start + n:k] = start + np.asarray(members, np.int64)
    return perm


def lightest_first_groups(lengths: np.ndarray, k: int, cap: Optional[int] = None) -> list[list[int]]:
    """Longest-processing-time-first assignment of sequences to ``k`` groups: sequences longest first (ties in
    index order), each to the group with the fewest tokens (ties: the lowest index) among those with fewer than
    ``cap`` members (None: no cap, so groups hold variable counts).

    Args: lengths [n] int (tokens per sequence); k >= 1 groups; cap: most members per group (k * cap >= n).
    Returns: k lists of indices into ``lengths``, each in placement order (a group may be empty when n < k).
    Never raises for valid arguments. Source: Graham's LPT rule (1969), as verl's ``rearrange_micro_batches``
    (sequences sorted by length, each to the lightest micro-batch).
    """
    members: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for r in np.argsort(-np.asarray(lengths), kind="stable"):
        j = min((j for j in range(k) if cap is None or len(members[j]) < cap), key=lambda j: (load[j], j))
        members[j].append(int(r))
        load[j] += int(lengths[r])
    return members


def token_budget_slots(lengths: np.ndarray, *, mini_rows: int, num_micro_batches: int, width: int,
                       num_shards: int = 1, long_rows: bool = True, variable_counts: bool = True,
                       max_sequences: Optional[int] = None) -> tuple[int, np.ndarray]:
    """Micro-batches chosen by tokens for a packed update: K' and the slot layout of every mini-batch.

    The budget is the tokens of one padded micro-batch of the configured K: ``mini_rows / num_shards / K`` rows
    of ``width`` = P + R (the same activation memory). For K' = 1, 2, ..., K the sequences of each mini-batch
    are assigned to its S x K' (shard, micro-batch) groups by :func:`lightest_first_groups` (group ``s * K' +
    j`` = micro-batch ``j`` on shard ``s``: sequences may change shard, which an update that does not depend on
    a row's micro-batch does not see either, its sums and populations being over the whole mini-batch), first
    with VARIABLE counts (no cap; verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``, in fixed shapes),
    then, where K' divides the block, with equal counts; the first K' whose shared packed geometry
    (:func:`micro_batch_rows` over the groups, M rows of L tokens) holds at most the budget wins. The configured
    K with equal counts always fits (at most one padded row per sequence; it is the fallback), so K' <= K.
    ``max_sequences`` caps the sequences of any micro-batch (``actor.max_sequences_per_micro_batch``): a K' whose
    groups cannot hold the mini-batch under the cap, or whose equal counts exceed it, is skipped; it bounds
    ``n_max`` and so the ``[slots, ...]`` batch arrays (``stapo_jax.tools.plan_analytic.packed_slot_bound``).

    Micro-batch ``j`` of shard ``s`` of mini-batch ``q`` owns the slot rows ``base + j + K' * i`` (``i <
    n_max``, ``base = (q * S + s) * K' * n_max``): the train step's strided split of a ``[S * K' * n_max]``
    mini-batch, shard-local under a row sharding. ``n_max`` is the most sequences any micro-batch of the update
    holds; the other slots are dummies (-1): :func:`gather_slots` gives them all-zero masks, so they have no
    tokens, no response tokens and no weight in any loss, denominator, threshold population or metric.

    Args:
      lengths: [B] int tokens per sequence (``attention_mask.sum(-1)``), B a multiple of ``mini_rows``.
      mini_rows: sequences per mini-batch; num_micro_batches: the configured K (``config.schema.micro_batch_count``);
      width: P + R; num_shards: S, data-parallel shards (K x S divides ``mini_rows``); long_rows: as
      :func:`micro_batch_rows`; variable_counts: False keeps equal counts (a permutation, no dummy slots);
      max_sequences: most sequences per micro-batch (None: no cap; raised to the fallback's ``mini_rows / S /
      K`` if below it).
    Returns:
      (K', slots): slots [B / mini_rows * S * K' * n_max] int64, the row each slot reads (-1 = dummy).
    Raises:
      ValueError: as :func:`balanced_row_order`, or a sequence longer than ``width`` (:func:`micro_batch_rows`).
    Source: verl ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu`` (``rearrange_micro_batches``), in fixed shapes.
    """
    lengths = np.asarray(lengths)
    b, k = check_split("token_budget_slots", lengths, mini_rows, num_micro_batches, num_shards)
    per = mini_rows // num_shards
    budget = (per // k) * int(width)

    def plan(kk, cap, check=True):  # -> {(mini-batch start, shard): K' groups of global rows} or None
        groups = {}
        for q in range(0, b, mini_rows):
            gs = [[q + i for i in g] for g in lightest_first_groups(lengths[q:q + mini_rows], num_shards * kk, cap)]
            m, L = micro_batch_rows([lengths[g] for g in gs], width, long_rows)
            if check and m * L > budget:
                return None
            groups.update({(q, s): gs[s * kk:(s + 1) * kk] for s in range(num_shards)})
        return groups

    cap = None if max_sequences is None else max(int(max_sequences), per // k)
    chosen = None
    for kk in range(1, k + 1):
        caps = ([cap] if variable_counts and (cap is None or num_shards * kk * cap >= mini_rows) else []) \
            + ([per // kk] if per % kk == 0 and (cap is None or per // kk <= cap) else [])
        chosen = next((g for g in (plan(kk, c) for c in caps) if g is not None), None)
        if chosen is not None:
            break
    if chosen is None:
        kk, chosen = k, plan(k, per // k, check=False)
    n_max = max(len(g) for gs in chosen.values() for g in gs)
    slots = np.full((b // mini_rows) * num_shards * kk * n_max, -1, np.int64)
    for (q, s), gs in chosen.items():
        base = ((q // mini_rows) * num_shards + s) * kk * n_max
        for j, g in enumerate(gs):
            slots[base + j + kk * np.arange(len(g))] = g
    return kk, slots


def gather_slots(x: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Rows of ``x`` in the slot layout of :func:`token_budget_slots`: ``out[i] = x[slots[i]]``, and all zeros
    (False / 0 / 0.0: no tokens, an all-zero ``response_mask`` and ``attention_mask``, zero advantages and
    log-probs) in dummy slots (``slots[i] = -1``).

    Args: x [B, ...] numpy, any dtype; slots [N] int64 in [-1, B). Returns [N, ...] in x's dtype. Raises:
    IndexError for a slot >= B. Source: verl's ``use_dynamic_bsz`` micro-batches, padded here to fixed shapes.
    """
    x = np.asarray(x)
    out = x[np.maximum(slots, 0)]
    return np.where((slots >= 0).reshape((-1,) + (1,) * (x.ndim - 1)), out, np.zeros((), x.dtype))
