"""The jitted pure update ``(TrainState, Batch) -> (TrainState, metrics)`` of one mini-batch.

Data flow (stapo_spec.md §3-4, conventions.md §2):

1. **Mini-batch population** (when the recipe's mask needs it: S2T or 20-Entropy with ``scope=minibatch``).
   S2T with ``minibatch_method=correction`` (default) and ``batch.old_entropy`` given: a *provisional* ``tau_h``
   = the quantile of ``old_entropy`` (exact on the first mini-batch of a step, θ = θ_old). Otherwise a
   **pre-pass**: a forward-only pass over all micro-batches gives ``log_probs`` and ``entropy`` of every response
   token under the current parameters and the mask is computed once on the whole mini-batch. Under ``jit`` with
   batch-sharded inputs the sort behind a quantile runs on the global array, so the population spans all
   data-parallel shards.
2. **Gradient pass**: ``lax.scan`` over micro-batches; each computes hidden states (``models.qwen3``) ->
   chunked log-probs + entropy (``stapo_jax.train.policy`` / ``stapo_jax.algo.logprobs``) -> the stored mask (or the mask
   of this micro-batch: ``microbatch`` scope, or S2T with the provisional ``tau_h``) ->
   ``compute_policy_loss`` and accumulates ``grad(loss_sum)``; it returns every token's stop-gradient
   log-prob and entropy.
3. **Correction** (S2T ``correction`` only): the exact ``tau_h`` from those entropies; for each micro-batch in
   which it changes a token's mask, ``grad(sum_exact - sum_provisional)`` is added (``lax.cond``; counted in
   ``s2t/correction_passes``). The result equals the pre-pass update.
4. Loss value, denominator and metrics once on the whole mini-batch with the final mask; one division of the
   gradient sum by that **global** denominator (a constant for ``token-sum`` / ``token-sum-norm``), so the update
   equals the full-batch gradient exactly; then the optax update. A non-finite gradient norm skips the update
   (``nonfinite_grad = 1``).

Batch layout follows ``stapo_jax.train.batching`` (verl): ``input_ids`` ``[B, P + R]``, response arrays ``[B, R]``.
Micro-batch ``k`` holds rows ``k, k + K, k + 2K, ...`` so that a batch sharded over rows stays local.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stapo_jax.algo.diagnostics import token_diagnostics
from stapo_jax.algo.masks import get_token_mask, masked_quantile
from stapo_jax.algo.objectives import compute_policy_loss, finalize_metrics, safe_divide
from stapo_jax.train.packing import PackedLayout
from stapo_jax.train.policy import response_log_probs_and_entropy
from stapo_jax.algo.recipes import Recipe, compute_token_mask
from stapo_jax.algo.s2t import correction_pass, minibatch_stats_mode, provisional_tau_h

__all__ = ["TrainState", "Batch", "make_train_step", "make_log_prob_fn", "batch_sharding", "COUNT_METRICS",
           "minibatch_stats_mode"]  # minibatch_stats_mode lives in stapo_jax.algo.s2t (re-exported for the trainer)

DATA_AXES = ("data", "fsdp")
# reported as totals over the mini-batches of a step, not means
COUNT_METRICS = ("s2t/n_keep", "grad/bounds_violated", "s2t/correction_passes", "s2t/corrected_tokens")


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of ``optimizer.init(params)``: every parameter-shaped leaf (AdamW ``mu``/``nu``) like its
    parameter (ZeRO-3 for the moments), everything else (counts, scalars) replicated.

    Args: ``params`` (arrays or ``ShapeDtypeStruct``s), ``param_shardings`` (same tree of ``NamedSharding``).
    Without this, ``jit(optimizer.init)`` returns replicated moments: 118 GB per chip for Qwen3-14B.
    """
    rep = NamedSharding(mesh, P())
    return optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), param_shardings,
                                 transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, nnx.Variable))


@flax.struct.dataclass
class TrainState:
    """Parameters, optimizer state and step counter; ``graphdef`` (static) rebuilds the ``nnx`` model."""

    params: Any
    opt_state: Any
    step: jax.Array
    graphdef: Any = flax.struct.field(pytree_node=False)

    @classmethod
    def create(cls, model: nnx.Module, optimizer: optax.GradientTransformation, mesh=None) -> "TrainState":
        """Split ``model``; with ``mesh``, place parameters by ``models.sharding.param_shardings`` and the
        optimizer state by :func:`optimizer_state_shardings` (AdamW moments sharded like their parameters)."""
        graphdef, params = nnx.split(model)
        if mesh is not None:
            from models.sharding import param_shardings

            p_sh = param_shardings(params, mesh)
            params = jax.device_put(params, p_sh)
            opt_sh = optimizer_state_shardings(optimizer, params, p_sh, mesh)
            opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
        else:
            opt_state = jax.jit(optimizer.init)(params)
        step = jnp.zeros((), jnp.int32)
        if mesh is not None:
            rep = NamedSharding(mesh, P())
            step = jax.device_put(step, rep)
        return cls(params=params, opt_state=opt_state, step=step, graphdef=graphdef)


@flax.struct.dataclass
class Batch:
    """One mini-batch. Shapes: ``input_ids`` / ``attention_mask`` ``[B, P + R]`` (int32 / bool; left-padded
    prompt then right-padded response); ``response_mask`` ``[B, R]`` (1 on response tokens); ``advantages``
    ``[B]`` or ``[B, R]`` float32; ``old_log_probs`` ``[B, R]`` float32 (trainer forward of the rollout policy);
    optional ``ref_log_probs`` ``[B, R]`` (KL loss), ``rollout_log_probs`` ``[B, R]`` (sampler log-probs, truncated
    IS), ``old_entropy`` ``[B, R]`` (S2T with ``stats_policy=old``); ``packing``: the micro-batches' padding-free
    rows (``stapo_jax.train.packing.pack_micro_batches`` with this step's K), None = run the padded rows."""

    input_ids: jax.Array
    attention_mask: jax.Array
    response_mask: jax.Array
    advantages: jax.Array
    old_log_probs: jax.Array
    ref_log_probs: Optional[jax.Array] = None
    rollout_log_probs: Optional[jax.Array] = None
    old_entropy: Optional[jax.Array] = None
    packing: Optional[PackedLayout] = None


def _validate(batch: Batch, num_micro_batches: int) -> None:
    b, t = batch.input_ids.shape
    if tuple(batch.attention_mask.shape) != (b, t):
        raise ValueError(f"attention_mask shape {tuple(batch.attention_mask.shape)} != input_ids {(b, t)}")
    if batch.response_mask.ndim != 2 or batch.response_mask.shape[0] != b or not 1 <= batch.response_mask.shape[1] < t:
        raise ValueError(f"response_mask must be [B={b}, R] with 1 <= R < {t}, got {tuple(batch.response_mask.shape)}")
    r = batch.response_mask.shape[1]
    for name in ("old_log_probs", "ref_log_probs", "rollout_log_probs", "old_entropy"):
        a = getattr(batch, name)
        if a is not None and tuple(a.shape) != (b, r):
            raise ValueError(f"{name} shape {tuple(a.shape)} must be [B, R] = {(b, r)}")
    if batch.advantages.shape not in ((b,), (b, r)):
        raise ValueError(f"advantages shape {tuple(batch.advantages.shape)} must be [B]={b} or [B, R]={(b, r)}")
    if num_micro_batches < 1 or b % num_micro_batches:
        raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1 and divide the batch size {b}")


def _split(x, k):
    """[B, ...] -> [K, B/K, ...] with micro-batch j = rows j, j+K, ... (strided: shard-local)."""
    if x is None:
        return None
    return x.reshape((x.shape[0] // k, k) + x.shape[1:]).swapaxes(0, 1)


def _unsplit(x):
    return x.swapaxes(0, 1).reshape((-1,) + x.shape[2:])


def make_log_prob_fn(*, temperature: float = 1.0, seq_chunk: int = 512, vocab_chunk: Optional[int] = None,
                     num_micro_batches: int = 1):
    """Forward-only ``(params, graphdef, input_ids, attention_mask, response_length, packing=None) -> (log_probs,
    entropy)``, ``[B, R]`` float32 each, micro-batched with ``lax.map`` (same rows/strides as the update; ``packing``
    as ``Batch.packing``). The trainer uses it for ``old_log_probs`` and the update for its pre-pass, so the first
    ratio of an update is 1.
    """

    def fn(params, graphdef, input_ids, attention_mask, response_length: int, packing=None):
        k = num_micro_batches

        def one(xs):
            ids, att, lay = xs
            model = nnx.merge(graphdef, params)
            return response_log_probs_and_entropy(model, ids, att, response_length, temperature=temperature,
                                                  seq_chunk=seq_chunk, vocab_chunk=vocab_chunk, packing=lay)

        lay = None if packing is None else jax.tree.map(lambda x: _split(x, k), packing)
        lp, ent = jax.lax.map(one, (_split(input_ids, k), _split(attention_mask, k), lay))
        return _unsplit(lp), _unsplit(ent)

    return fn


def batch_sharding(mesh) -> NamedSharding:
    """Rows over the data axes (``data``, ``fsdp``) present in ``mesh``, everything else replicated."""
    axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    return NamedSharding(mesh, P(axes))


def make_train_step(
    recipe: Recipe,
    optimizer: optax.GradientTransformation,
    *,
    num_micro_batches: int = 1,
    temperature: float = 1.0,
    seq_chunk: int = 512,
    vocab_chunk: Optional[int] = None,
    vocab_size: Optional[int] = None,
    mesh=None,
    state_shardings=None,
    donate: bool = False,
):
    """Build the jitted update ``step(state, batch) -> (state, metrics)``.

    Args:
      recipe: a :class:`~stapo_jax.algo.recipes.Recipe` (loss, token mask and its scope).
      optimizer: optax transformation (``stapo_jax.train.optim.make_optimizer``).
      num_micro_batches: K, gradient-accumulation steps (must divide B).
      temperature: sampling temperature (logits are divided by it).
      seq_chunk / vocab_chunk: chunk sizes of the LM-head pass (``chunked_log_probs_and_entropy``).
      vocab_size: |V| for the Theorem 3.1 bound metrics (None: skipped).
      mesh: optional mesh; with it the step is jitted with explicit shardings: the batch rows over
        (``data``, ``fsdp``), the state (in and out) by ``state_shardings`` (required with ``mesh``, e.g.
        ``jax.tree.map(lambda x: x.sharding, TrainState.create(model, optimizer, mesh))``), metrics replicated.
      donate: donate the state buffers.

    Returns:
      ``step``; metrics (float32 scalars): ``loss``, ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``,
      ``ppo_kl``, ``ratio_mean``, ``entropy``, ``grad_norm``, ``nonfinite_grad``, ``loss_denominator``,
      ``s2t/*`` and ``phase/*`` diagnostics (``s2t/tau_h`` = the recipe's entropy quantile of the population;
      ``s2t/correction_passes`` / ``s2t/corrected_tokens`` with the S2T correction method),
      plus ``kl_loss`` / ``entropy_loss`` / ``rollout_is_weight`` when active.

    Raises:
      ValueError (at call time): batch fields missing or misshaped, K not dividing B, S2T ``stats_policy=old``
      without ``old_entropy``.
    """
    loss_cfg = recipe.loss
    mask = recipe.token_mask
    selects = mask != "none" and get_token_mask(mask).selects  # kl_cov: a selection, not a keep mask
    k = num_micro_batches
    lp_fn = make_log_prob_fn(temperature=temperature, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk,
                             num_micro_batches=k)
    q = recipe.s2t.entropy_quantile
    sg = jax.lax.stop_gradient

    def _threshold(stats, entropy, valid):
        """The S2T entropy threshold the mask used (its own population, e.g. ``positive_adv``); for other masks
        the ``entropy_quantile`` of the valid tokens, for the phase diagnostics."""
        if "s2t/tau_h" in stats:
            return stats["s2t/tau_h"]
        return masked_quantile(entropy, valid, q, recipe.s2t.quantile_method)

    def step(state: TrainState, batch: Batch):
        _validate(batch, k)
        mode = minibatch_stats_mode(recipe, batch.old_entropy is not None)
        if mode == "old" and batch.old_entropy is None:
            raise ValueError("s2t.stats_policy='old' needs batch.old_entropy")
        r = batch.response_mask.shape[1]
        graphdef, params = state.graphdef, state.params
        resp = batch.response_mask.astype(jnp.float32)
        key = jax.random.fold_in(jax.random.PRNGKey(0), state.step)
        keep_all, tau_all, tau_guess, mask_stats = None, None, None, None
        if mode in ("old", "prepass"):
            if mode == "old":
                mask_stats = (batch.old_log_probs, batch.old_entropy)
            else:
                mask_stats = lp_fn(sg(params), graphdef, batch.input_ids, batch.attention_mask, r, batch.packing)
            keep_all, st = compute_token_mask(recipe, log_probs=mask_stats[0], entropy=mask_stats[1],
                                              advantages=batch.advantages, response_mask=resp,
                                              old_log_probs=batch.old_log_probs, key=key)
            tau_all = _threshold(st, mask_stats[1], resp)
        elif mode == "correction":
            tau_guess = provisional_tau_h(recipe, batch.old_log_probs, batch.old_entropy, batch.advantages, resp)

        def forward(p, mb):
            return response_log_probs_and_entropy(nnx.merge(graphdef, p), mb.input_ids, mb.attention_mask, r,
                                                  temperature=temperature, seq_chunk=seq_chunk,
                                                  vocab_chunk=vocab_chunk, packing=mb.packing)

        def surrogate(lp, ent, mb, keep):
            kl_sel = keep if selects else None
            return compute_policy_loss(lp, mb.old_log_probs, mb.advantages, mb.response_mask.astype(jnp.float32),
                                       None if selects else keep, loss_cfg, entropy=ent,
                                       ref_log_probs=mb.ref_log_probs, rollout_log_probs=mb.rollout_log_probs,
                                       kl_cov_selection=kl_sel, renormalize=recipe.renormalize)

        mbs = jax.tree.map(lambda x: _split(x, k), batch)

        def micro(grad_acc, xs):
            mb, keep_mb, j = xs

            def loss_fn(p):
                lp, ent = forward(p, mb)
                sg_lp, sg_ent = sg(lp), sg(ent)
                mresp = mb.response_mask.astype(jnp.float32)
                keep, tau, st = keep_mb, tau_all, {}
                if keep is None and mask != "none":
                    keep, st = compute_token_mask(recipe, log_probs=sg_lp, entropy=sg_ent, advantages=mb.advantages,
                                                  response_mask=mresp, old_log_probs=mb.old_log_probs,
                                                  key=jax.random.fold_in(key, j), tau_h=tau_guess)
                if tau is None:
                    tau = _threshold(st, sg_ent, mresp)
                return surrogate(lp, ent, mb, keep)[0], (sg_lp, sg_ent, keep, tau)

            g, out = jax.grad(loss_fn, has_aux=True)(params)
            return jax.tree.map(jnp.add, grad_acc, g), out

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, (lps, ents, keeps, taus) = jax.lax.scan(micro, zeros, (mbs, _split(keep_all, k), jnp.arange(k)))
        lp_all, ent_all = _unsplit(lps), _unsplit(ents)
        keep_full = keep_all if keep_all is not None else (None if keeps is None else _unsplit(keeps))
        extra = {}
        if mode == "correction":
            keep_full, stats = compute_token_mask(recipe, log_probs=lp_all, entropy=ent_all,
                                                  advantages=batch.advantages, response_mask=resp)
            tau_all = stats["s2t/tau_h"]
            grad_sum, extra = correction_pass(forward, surrogate, params, grad_sum, mbs, keeps, _split(keep_full, k))
        b = batch.response_mask.shape[0]
        tau_rows = tau_all if tau_all is not None else _unsplit(jnp.broadcast_to(taus[:, None], (k, b // k)))[:, None]
        # loss value, denominator and metrics on the whole mini-batch with the final mask (stop-gradient inputs);
        # the token diagnostics from the statistics that defined the mask (pre-pass / old pass, else this pass)
        loss_sum, den, m = surrogate(lp_all, ent_all, batch, keep_full)
        m = dict(m)
        diag_lp, diag_ent = mask_stats if mask_stats is not None else (lp_all, ent_all)
        m.update(token_diagnostics(diag_lp, diag_ent, batch.advantages, batch.old_log_probs, resp,
                                   None if selects else keep_full, tau_p=recipe.s2t.tau_p, tau_h=tau_rows,
                                   clip_ratio_low=loss_cfg.clip_ratio_low, clip_ratio_high=loss_cfg.clip_ratio_high,
                                   clip_ratio_c=loss_cfg.clip_ratio_c, vocab_size=vocab_size,
                                   log_ratio_clamp=loss_cfg.log_ratio_clamp))
        grads = jax.tree.map(lambda g: safe_divide(g, den), grad_sum)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        updates, new_opt = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep_old = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        new_state = state.replace(params=jax.tree.map(keep_old, new_params, params),
                                  opt_state=jax.tree.map(keep_old, new_opt, state.opt_state),
                                  step=state.step + finite.astype(jnp.int32))
        metrics = finalize_metrics(m, den)
        for name in COUNT_METRICS:
            if name in m:
                metrics[name] = m[name][0]
        metrics.update(extra)
        metrics.update({
            "loss": safe_divide(loss_sum, den),
            "loss_denominator": den,
            "grad_norm": grad_norm,
            "nonfinite_grad": (~finite).astype(jnp.float32),
            # an empty population has a NaN threshold; the metric reports 0 there (no NaN in the logs)
            "s2t/tau_h": jnp.nan_to_num(tau_all, nan=0.0) if tau_all is not None else jnp.mean(jnp.nan_to_num(taus)),
        })
        return new_state, metrics

    if mesh is None:
        return jax.jit(step, donate_argnums=(0,) if donate else ())
    if state_shardings is None:
        raise ValueError("make_train_step(mesh=...) needs state_shardings (jax.tree.map(lambda x: x.sharding, state))")
    bs = batch_sharding(mesh)
    rep = NamedSharding(mesh, P())
    return jax.jit(step, in_shardings=(state_shardings, bs), out_shardings=(state_shardings, rep),
                   donate_argnums=(0,) if donate else ())

