"""One RL policy update (the "update" box of DESIGN.md's loop): micro-batch count from the mesh, old log-probs
over the rollout batch, one optimizer step per mini-batch placed on the data-parallel devices; plus the
preemption (SIGTERM) agreement and the finite-parameter check the loop runs after each update.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from stapo_jax.algo.masks import get_token_mask
from stapo_jax.config.schema import Config, micro_batch_count
from stapo_jax.core.errors import ConfigError
from stapo_jax.runtime.collectives import allgather_max
from stapo_jax.runtime.stopping import Preemption
from stapo_jax.train.packing import gather_slots, pack_micro_batches, token_budget_slots
from stapo_jax.train.train_step import COUNT_METRICS, Batch, TrainState, place_rows


def stop_requested(preempt: Preemption) -> bool:
    """True on every process when SIGTERM or SIGINT (``runtime.stopping.Preemption``) reached any of them (a max
    all-gather over processes, so all of them
    stop after the same step); a collective: every process must call it at the same point.
    Raises what the JAX all-gather raises when the processes are out of step. Source: SLURM / TPU preemption sends
    SIGTERM. Returns a Python bool."""
    return allgather_max(float(preempt.requested)) > 0


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


def num_micro_batches(cfg: Config, rows: int, mesh) -> int:
    """K micro-batches per mini-batch of ``rows`` sequences (global over processes): each data-parallel shard
    (``mesh.data`` x ``mesh.fsdp``) holds ``rows / dp`` rows, cut into micro-batches of
    ``actor.ppo_micro_batch_size`` (verl's gradient accumulation); a micro-batch size above the rows per shard
    gives K = 1 (the shard's rows, fewer than asked): :func:`micro_batch_count`.

    Raises:
      ConfigError: ``rows`` does not split evenly into shards and micro-batches (names the keys to change), e.g.
        64 rows per shard and micro-batches of 48 (K = 1 would be micro-batches of 64, above the size asked).
    Returns a Python int.
    """
    dp = data_parallel_size(mesh)
    k = micro_batch_count(rows, dp, cfg.actor.ppo_micro_batch_size)
    if k is None:
        raise ConfigError(f"mini-batch of {rows} sequences (actor.ppo_mini_batch_size x rollout.n) does not split "
                          f"into {dp} data-parallel shards ({jax.process_count()} processes x "
                          f"{jax.local_device_count()} devices, mesh.data x mesh.fsdp) of micro-batches of "
                          f"actor.ppo_micro_batch_size={cfg.actor.ppo_micro_batch_size}: change "
                          f"actor.ppo_mini_batch_size, trainer.train_batch_size, actor.ppo_micro_batch_size or "
                          f"mesh.*")
    return k


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
    mini_rows, num_micro_batches (K from :func:`num_micro_batches`), num_shards (data-parallel shards);
    long_rows as ``stapo_jax.train.packing.micro_batch_rows``; variable_counts: False keeps equal sequence
    counts per micro-batch; max_sequences: most sequences per micro-batch (``actor.sequences_cap()``; None: no
    cap). Returns: (K' in [1, K], slots [B / mini_rows * S * K' * n_max] int64, -1 = dummy)
    for :func:`update_policy`'s ``slots``. Raises: ValueError for a mask that is not [B, P + R], sizes < 1, or K
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


def update_policy(state: TrainState, exp, step_fns, log_prob_fn, *, mini_rows: int, ppo_epochs: int = 1,
                  mesh=None, num_micro_batches: int = 1, use_remove_padding: bool = False, long_rows: bool = True,
                  slots=None, geometries=None, compile_only: bool = False, ref_params=None):
    """Old log-probs over the whole rollout batch (trainer forward, θ_old), then one optimizer step per
    mini-batch of ``mini_rows`` sequences. ``step_fns = (first, rest)``: with ``s2t.minibatch_method=prepass``
    the first mini-batch uses a step that takes its token statistics from the old-log-prob pass (θ = θ_old
    there, stapo_spec §3), saving the pre-pass; with ``correction`` both are the same step (``old_entropy``
    gives it the provisional tau_h, exact on the first mini-batch).

    Args:
      exp: an ``experience.Experience`` whose ``arrays`` hold ``input_ids`` int32 / ``attention_mask`` bool [B, P+R],
        ``response_mask`` bool [B, R], ``advantages`` float32 [B] or [B, R] (and optionally ``rollout_log_probs``
        float32 [B, R]); the same global rows on every process. ``mini_rows`` must divide into the mesh's
        data-parallel shards (``num_micro_batches`` checks that first).
      mesh: the training mesh (rows go to its data-parallel devices); None = one device.
      num_micro_batches: K of ``step_fns`` / ``log_prob_fn`` (the packed layout is planned per micro-batch).
      use_remove_padding: pack each micro-batch (``stapo_jax.train.packing.pack_micro_batches``, each
        data-parallel shard its own rows), planned on the host once per mini-batch and given to the old-log-prob
        pass and every epoch's update through ``Batch.packing`` (verl's ``model.use_remove_padding``).
      long_rows: packed rows may be longer than ``P + R`` (one row per micro-batch and shard; only for an
        attention whose cost follows the segments, ``stapo_jax.train.packing.packing_long_rows``).
      slots: with ``use_remove_padding``, the slot layout of :func:`token_budget_micro_batches` (for this
        ``num_micro_batches``): every mini-batch becomes ``len(slots) / (B / mini_rows)`` rows, micro-batch ``j``
        holding a variable number of sequences and dummy slots with all-zero masks (``packing.gather_slots``),
        which add nothing to any loss, denominator (seq-mean modes count only non-empty rows), threshold
        population or metric. Only where :func:`balance_allowed`.
      geometries: with ``use_remove_padding``, the bounded set of packed ``(M, L)`` of ``trainer.precompile``
        (``packing.fixed_geometries``; None: the tightest geometry of each mini-batch).
      ref_params: the reference policy's parameters (``actor.use_kl_loss``; the policy at the start of RL, same
        tree and shardings as ``state.params``): the same log-prob program gives ``ref_log_probs`` [B, R] float32
        for every mini-batch's ``Batch`` (verl's ``compute_ref_log_prob``, at the rollout temperature); None:
        no KL term's inputs.
      compile_only: compile (``jit(...).lower(...).compile()``) the old-log-prob pass and every step this update
        would run, at exactly the shapes, dtypes and shardings of its arrays, without running them; returns
        ``(state, {})`` with ``state`` untouched (the compiled programs serve the later calls).
      step_fns may donate the state (``make_train_step(donate=True)``, as the trainer builds them): ``state``'s
      buffers are then consumed and only the returned state is valid. The mini-batch steps are dispatched
      back to back; their metrics come to the host once, after the last one.
    Returns:
      (state, metrics: float per key, averaged over mini-batches; ``COUNT_METRICS`` summed; plus
      ``sampler_trainer/logp_diff_mean|max`` when the sampler's log-probs are present, conventions.md §5).
    Raises: ConfigError when ``mini_rows`` does not split into shards and micro-batches; ValueError from the step
    for misshaped arrays."""
    a, num_rows, mini_rows = _arrange_rows(exp.arrays, exp.num_rows, mini_rows, use_remove_padding, slots)
    # every process holds the same global experience (multi-controller): mini-batch k is the global row slice
    # [k*M, (k+1)*M), each device receives its rows of it; the old log-probs come back with an all-gather
    put = lambda x: place_rows(x, mesh)  # noqa: E731
    packing = dict(num_micro_batches=num_micro_batches, num_shards=data_parallel_size(mesh), long_rows=long_rows,
                   geometries=geometries) if use_remove_padding else None
    old_lp, old_ent, ref_lp, layouts = _old_log_probs(state, a, log_prob_fn, num_rows, mini_rows, mesh, put,
                                                      packing, compile_only, ref_params)
    metrics: list[dict] = []
    compiled: list = []
    rollout_lp = a.get("rollout_log_probs")
    for epoch in range(ppo_epochs):  # verl: ppo_epochs passes, mini-batches in order (shuffle false)
        for s in range(0, num_rows, mini_rows):
            sl = slice(s, s + mini_rows)
            batch = Batch(input_ids=put(a["input_ids"][sl]), attention_mask=put(a["attention_mask"][sl]),
                          response_mask=put(a["response_mask"][sl]), advantages=put(a["advantages"][sl]),
                          old_log_probs=put(old_lp[sl]), old_entropy=put(old_ent[sl]),
                          rollout_log_probs=None if rollout_lp is None else put(rollout_lp[sl]),
                          ref_log_probs=None if ref_lp is None else put(ref_lp[sl]),
                          packing=layouts.get(s))
            fn = step_fns[0 if (epoch == 0 and s == 0) else 1]
            if compile_only:
                if fn not in compiled:
                    compiled.append(fn)
                    fn.lower(state, batch).compile()
                continue
            state, m = fn(state, batch)
            metrics.append(m)  # device scalars: no host round trip between mini-batches
    if compile_only:
        return state, {}
    return state, _update_metrics(jax.device_get(metrics), a, old_lp)


def _arrange_rows(a: dict, num_rows: int, mini_rows: int, use_remove_padding: bool, slots) -> tuple[dict, int, int]:
    """``(arrays, num_rows, mini_rows)`` in the row order the packed update uses: gathered into ``slots`` (rows
    per mini-batch change), or as they are."""
    if use_remove_padding and slots is not None:
        if len(slots) % (num_rows // mini_rows):
            raise ValueError(f"update_policy: {len(slots)} slots for {num_rows // mini_rows} mini-batches")
        a = {key: gather_slots(v, slots) if getattr(v, "shape", ())[:1] == (num_rows,) else v for key, v in a.items()}
        return a, len(slots), len(slots) // (num_rows // mini_rows)
    return a, num_rows, mini_rows


def _old_log_probs(state: TrainState, a: dict, log_prob_fn, num_rows: int, mini_rows: int, mesh, put,
                   packing: Optional[dict], compile_only: bool, ref_params=None):
    """``(old_log_probs, old_entropy, ref_log_probs, layouts)``: the θ_old pass per mini-batch, gathered to
    ``[B, R]`` float32 on the host (zeros with ``compile_only``, which compiles the pass once), the same pass
    with ``ref_params`` (None without them; the same compiled program), and each mini-batch's packed layout
    (``packing``: ``pack_micro_batches``' keyword arguments, None = padded rows) by its first row."""
    R = a["response_mask"].shape[1]
    get = (lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))) if mesh is not None \
        else np.asarray
    old_lp, old_ent, ref_lp, layouts = [], [], [], {}
    for s in range(0, num_rows, mini_rows):
        if packing is not None:
            lay = pack_micro_batches(a["input_ids"][s:s + mini_rows], a["attention_mask"][s:s + mini_rows], R,
                                     **packing)
            layouts[s] = jax.tree.map(put, lay)
        args = (state.params, state.graphdef, put(a["input_ids"][s:s + mini_rows]),
                put(a["attention_mask"][s:s + mini_rows]), R, layouts.get(s))
        if compile_only:
            if s == 0:
                log_prob_fn.lower(*args).compile()
            for out in (old_lp, old_ent, ref_lp):
                out.append(np.zeros((mini_rows, R), np.float32))
            continue
        lp, ent = log_prob_fn(*args)
        old_lp.append(get(lp))
        old_ent.append(get(ent))
        if ref_params is not None:
            ref_lp.append(get(log_prob_fn(ref_params, *args[1:])[0]))
    ref = np.concatenate(ref_lp) if ref_params is not None else None
    return np.concatenate(old_lp), np.concatenate(old_ent), ref, layouts


def _update_metrics(metrics: list[dict], a: dict, old_lp: np.ndarray) -> dict[str, float]:
    """The mini-batches' metrics averaged (``COUNT_METRICS`` summed), plus the sampler-trainer log-prob gap."""
    out = {k: float((np.sum if k in COUNT_METRICS else np.mean)([m[k] for m in metrics])) for k in metrics[0]}
    if "rollout_log_probs" in a:  # sampler vs trainer log-prob gap on valid tokens (conventions.md §5)
        mask = a["response_mask"]
        gap = np.abs(old_lp - a["rollout_log_probs"])[mask]
        out["sampler_trainer/logp_diff_mean"] = float(gap.mean()) if gap.size else 0.0
        out["sampler_trainer/logp_diff_max"] = float(gap.max()) if gap.size else 0.0
    return out

@jax.jit
def all_finite(tree) -> jax.Array:
    """Scalar bool array: every element of every leaf of ``tree`` (e.g. the parameters) is finite.
    Never raises. Source: the nonfinite-gradient guard of verl's actor (skip the update)."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))
