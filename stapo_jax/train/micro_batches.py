"""How an update's rows split: the data-parallel shards of the mesh, the micro-batch count K of a mini-batch
(verl's gradient accumulation), the token-budget layout of packed micro-batches and the bounded packed
geometries of ``trainer.precompile``; and whether a recipe's update lets rows be regrouped. Host-side integer
arithmetic and numpy only; the policy update (``stapo_jax.train.policy_update``), the batch-shape checks, the
SFT warm-up and ``stapo-jax plan`` all use these.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from stapo_jax.algo.masks import get_token_mask
from stapo_jax.train.packing import fixed_geometries, token_budget_slots

__all__ = ["balance_allowed", "data_parallel_size", "token_budget_micro_batches",
           "update_geometries"]


def balance_allowed(recipe) -> bool:
    """True when a mini-batch's update does not depend on which micro-batch holds a row, so the rows may be
    regrouped for packing (``slots``, :func:`token_budget_micro_batches`): no token mask, or a mask whose
    registry entry says its rows may be regrouped (``TokenMask.rows_reorderable``: S2T, 20-Entropy) taken over
    the whole mini-batch. False for per-micro-batch populations and for Clip-Cov / KL-Cov (random selections
    keyed per micro-batch). ``recipe``: a ``stapo_jax.algo.recipes.Recipe`` (its mask already validated); never
    raises.
    Returns a Python bool."""
    if recipe.token_mask == "none":
        return True
    return get_token_mask(recipe.token_mask).rows_reorderable and recipe.mask_scope == "minibatch"


def data_parallel_size(mesh) -> int:
    """Data-parallel shards of the batch rows: ``mesh.data`` x ``mesh.fsdp`` (1 without a mesh).
    Returns a Python int. Never raises. Source: verl's data-parallel size (FSDP ranks)."""
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[a] for a in ("data", "fsdp") if a in mesh.axis_names]))


def token_budget_micro_batches(attention_mask: np.ndarray, *, mini_rows: int, num_micro_batches: int,
                               num_shards: int = 1, long_rows: bool = True,
                               variable_counts: bool = True,
                               max_sequences: Optional[int] = None) -> tuple[int, np.ndarray]:
    """K and the slot layout for a packed update chosen by tokens: the fewest micro-batches per mini-batch (more
    sequences each, a variable number of them, so one long sequence no longer sets every micro-batch's row)
    whose packed rows hold no more tokens than one padded micro-batch of the configured K (``mini_rows /
    num_shards / K`` rows of ``P + R``): the same activation memory, far fewer computed tokens (verl's
    ``ppo_max_token_len_per_gpu`` with ``use_dynamic_bsz``, in fixed shapes; ``packing.token_budget_slots``).
    Only for updates that do not depend on which micro-batch holds a row (:func:`balance_allowed`).

    Args: attention_mask [B, P + R] of the whole rollout batch (numpy, B a multiple of ``mini_rows``);
    mini_rows, num_micro_batches (K: ``config.schema.micro_batch_count``), num_shards (data-parallel shards);
    long_rows as ``stapo_jax.train.packing.micro_batch_rows``; variable_counts: False keeps equal sequence
    counts per micro-batch; max_sequences: most sequences per micro-batch (``actor.sequences_cap()``; None: no
    cap). Returns: (K' in [1, K], slots [B / mini_rows * S * K' * n_max] int64, -1 = dummy)
    for ``policy_update.update_policy``'s ``slots``. Raises: ValueError for a mask that is not [B, P + R], sizes < 1, or K
    not dividing the rows per shard; as ``packing.token_budget_slots`` otherwise. Source: verl
    ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``.
    """
    if np.ndim(attention_mask) != 2:
        raise ValueError(f"attention_mask must be [B, P + R], got shape {np.shape(attention_mask)}")
    if min(mini_rows, num_micro_batches, num_shards) < 1 or mini_rows % num_shards or \
            (mini_rows // num_shards) % num_micro_batches:
        raise ValueError(f"mini_rows={mini_rows} must split into num_shards={num_shards} x "
                         f"num_micro_batches={num_micro_batches} (actor.ppo_micro_batch_size, all >= 1)")
    mask = np.asarray(attention_mask).astype(bool)
    return token_budget_slots(mask.sum(1), mini_rows=mini_rows, num_micro_batches=num_micro_batches,
                              width=mask.shape[1], num_shards=num_shards, long_rows=long_rows,
                              variable_counts=variable_counts, max_sequences=max_sequences)


def update_geometries(mini_rows: int, num_micro_batches: int, num_shards: int, width: int,
                      long_rows: bool) -> list[tuple[int, int]]:
    """The fixed packed geometries of one micro-batch block (``mini_rows / num_shards / K`` sequences of
    ``width`` = P + R tokens): :func:`stapo_jax.train.packing.fixed_geometries`. Ints in, ``[(M, L)]`` int pairs
    out;
    raises ValueError for sizes that do not split. Source: issue 33's bounded shapes."""
    per, rem = divmod(mini_rows, num_shards * num_micro_batches)
    if rem or per < 1:
        raise ValueError(f"mini_rows={mini_rows} does not split into {num_shards} shards x {num_micro_batches} "
                         f"micro-batches")
    return fixed_geometries(per, width, long_rows)
