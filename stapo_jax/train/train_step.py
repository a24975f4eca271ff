"""The jitted pure update ``(TrainState, Batch) -> (TrainState, metrics)`` of one mini-batch: a generic
accumulate-and-apply step that names no token mask.

Data flow (stapo_spec.md §3-4, conventions.md §2):

1. ``strategy.prepare``: the recipe's mask strategy (``stapo_jax.train.mask_strategy.mask_strategy``) does what
   its mask needs before the gradient pass: nothing (per-micro-batch masks), the mask on the whole mini-batch
   from a forward-only pre-pass or from the old policy's statistics, or S2T's provisional threshold
   (``stapo_jax.algo.s2t``, through ``stapo_jax.train.mask_strategy.s2t_strategy``).
2. **Gradient pass**: ``lax.scan`` over the K micro-batches (micro-batch ``j`` = rows ``j, j + K, ...``, so a
   batch sharded over rows stays local); each computes log-probs + entropy (``forward`` below:
   ``stapo_jax.train.policy``), asks ``strategy.micro_mask`` for its mask, and accumulates
   ``grad(compute_policy_loss(...).loss_sum)``; it returns every token's stop-gradient log-prob and entropy.
3. ``strategy.finish``: the final mask of the mini-batch (S2T's correction pass adds its gradient here).
4. Loss value, denominator and metrics once on the whole mini-batch with the final mask; one division of the
   gradient sum by that **global** denominator (a constant for ``token-sum`` / ``token-sum-norm``), so the update
   equals the full-batch gradient exactly; then the optax update. A non-finite gradient norm skips the update
   (``nonfinite_grad = 1``).

Batch layout follows ``stapo_jax.train.batching`` (verl): ``input_ids`` ``[B, P + R]``, response arrays ``[B, R]``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from stapo_jax.algo.loss_inputs import PolicyLossInputs
from stapo_jax.algo.objectives import finalize_metrics, get_policy_loss_fn, kl_has_own_denominator, kl_loss, safe_divide
from stapo_jax.algo.recipes import Recipe, mask_selects_tokens
from stapo_jax.train.mask_strategy import (FinishInputs, UpdateContext, count_metrics, first_minibatch_recipe,
                                           join_micro_batches, mask_metrics, mask_strategy, split_micro_batches)
from stapo_jax.train.optim import update_with_norm
from stapo_jax.train.packing import PackedLayout
from stapo_jax.train.policy import response_log_probs_and_entropy

__all__ = ["TrainState", "Batch", "make_train_step", "make_update_steps", "make_log_prob_fn", "batch_sharding", "masked_policy_loss",
           "kl_apart",
           "optimizer_state_shardings", "init_optimizer_state"]

DATA_AXES = ("data", "fsdp")


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of ``optimizer.init(params)``: every parameter-shaped leaf (AdamW ``mu``/``nu``) like its
    parameter (ZeRO-3 for the moments), everything else (counts, scalars) replicated.

    Args: ``params`` (arrays or ``ShapeDtypeStruct``s), ``param_shardings`` (same tree of ``NamedSharding``).
    Without this, ``jit(optimizer.init)`` returns replicated moments: 118 GB per chip for Qwen3-14B.
    Raises: ValueError from optax / jax when the trees do not match. Source: ZeRO-3 / FSDP sharding of optimizer
    state (verl's FSDP actor).
    """
    rep = NamedSharding(mesh, P())
    return optax.tree_map_params(optimizer, lambda _, s: s, jax.eval_shape(optimizer.init, params), param_shardings,
                                 transform_non_params=lambda _: rep, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_optimizer_state(optimizer: optax.GradientTransformation, params):
    """``optimizer.init(params)`` placed as the update steps return it: on a mesh (``NamedSharding`` parameters)
    by :func:`optimizer_state_shardings` (moments like their parameters, counts replicated on the mesh), so a
    step's second call does not compile again for the counts' sharding; otherwise on the parameters' device.
    ``params``: the model's parameter tree (float arrays). Raises: ValueError from optax / jax for a tree the
    optimizer cannot take. Source: optax ``init``; ZeRO-3 placement of optimizer state (verl's FSDP actor)."""
    leaf = jax.tree.leaves(params)[0]
    if isinstance(leaf.sharding, NamedSharding):
        shardings = jax.tree.map(lambda x: x.sharding, params)
        out = optimizer_state_shardings(optimizer, params, shardings, leaf.sharding.mesh)
        return jax.jit(optimizer.init, out_shardings=out)(params)
    return jax.jit(optimizer.init)(params)


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

            params = jax.device_put(params, param_shardings(params, mesh))
        opt_state = init_optimizer_state(optimizer, params)
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


def make_log_prob_fn(*, temperature: float = 1.0, seq_chunk: int = 512, vocab_chunk: Optional[int] = None,
                     num_micro_batches: int = 1):
    """Forward-only ``(params, graphdef, input_ids, attention_mask, response_length, packing=None) -> (log_probs,
    entropy)``, ``[B, R]`` float32 each, micro-batched with ``lax.map`` (same rows/strides as the update; ``packing``
    as ``Batch.packing``). The trainer uses it for ``old_log_probs`` and the update for its pre-pass, so the first
    ratio of an update is 1.
    Raises: ValueError (at call time) when the rows do not split into ``num_micro_batches``. Source: verl
    ``compute_log_prob`` (the old-log-prob pass).
    """

    def fn(params, graphdef, input_ids, attention_mask, response_length: int, packing=None):
        k = num_micro_batches

        def one(xs):
            ids, att, lay = xs
            model = nnx.merge(graphdef, params)
            return response_log_probs_and_entropy(model, ids, att, response_length, temperature=temperature,
                                                  seq_chunk=seq_chunk, vocab_chunk=vocab_chunk, packing=lay)

        lay = None if packing is None else jax.tree.map(lambda x: split_micro_batches(x, k), packing)
        lp, ent = jax.lax.map(one, (split_micro_batches(input_ids, k), split_micro_batches(attention_mask, k), lay))
        return join_micro_batches(lp), join_micro_batches(ent)

    return fn


def batch_sharding(mesh) -> NamedSharding:
    """Rows over the data axes (``data``, ``fsdp``) present in ``mesh``, everything else replicated.
    Takes a ``jax.sharding.Mesh``; the sharding is for ``[B, ...]`` arrays. Never raises. Source: verl's
    data-parallel split of the rows."""
    axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    return NamedSharding(mesh, P(axes))


def place_rows(x, mesh) -> jax.Array:
    """The host array ``x`` [B, ...] (the same global rows on every process) as a global ``jax.Array`` with its
    rows over the data axes of ``mesh`` (:func:`batch_sharding`), each process filling only its own devices'
    rows (``jax.make_array_from_callback``); one device's array when ``mesh`` is None. B must divide into
    ``micro_batches.data_parallel_size(mesh)`` shards (callers check it and name their key). The RL update and the SFT
    warm-up place their batches with it. Any dtype (kept). Raises: ValueError from JAX when B does not divide
    over the data shards. Source: JAX's multi-controller input pattern (``jax.make_array_from_callback``), as
    MaxText feeds global batches."""
    if mesh is None:
        return jnp.asarray(x)
    return jax.make_array_from_callback(x.shape, batch_sharding(mesh), lambda idx: x[idx])


def masked_policy_loss(recipe: Recipe, fold_kl: bool = True) -> Callable:
    """``surrogate(log_probs, entropy, mb, keep) -> (loss_sum, denominator, metrics)``: the recipe's registered
    policy loss (``objectives.get_policy_loss_fn(recipe.policy_loss, recipe.extensions)``, signature of
    ``compute_policy_loss``, the settings it declares bound) on a (micro-)batch ``mb`` (a ``Batch``: ``[N, R]``
    arrays) with the mask ``keep`` ``[N, R]`` bool (or None) applied the way its registry entry says: a keep mask,
    or for a selecting mask (``kl_cov``) the ``kl_cov_selection``. log_probs / entropy: ``[N, R]`` float32 of the
    current policy. fold_kl: False leaves the KL term out of ``loss_sum`` (:func:`kl_apart`).
    Raises: ValueError as ``compute_policy_loss`` (misshaped arrays). Source: conventions.md §1.2; verl
    ``compute_policy_loss_kl_cov`` (selection)."""
    selects = mask_selects_tokens(recipe.token_mask)
    policy_loss = get_policy_loss_fn(recipe.policy_loss, recipe.extensions)

    def surrogate(lp, ent, mb, keep):
        inputs = PolicyLossInputs(old_log_probs=mb.old_log_probs, log_probs=lp, advantages=mb.advantages,
                                  response_mask=mb.response_mask.astype(jnp.float32),
                                  token_mask=None if selects else keep, entropy=ent, ref_log_probs=mb.ref_log_probs,
                                  rollout_log_probs=mb.rollout_log_probs,
                                  kl_cov_selection=keep if selects else None, renormalize=recipe.renormalize,
                                  fold_kl=fold_kl)
        return policy_loss(inputs, recipe.loss)

    return surrogate


def kl_apart(recipe: Recipe) -> bool:
    """Whether the update differentiates the KL term apart from the policy gradient: its denominator (every valid
    token) can differ from the policy gradient's (the kept tokens), and the kept-token count of the mini-batch is
    known only after the gradient pass (``objectives.kl_has_own_denominator``). Returns a bool.
    Never raises. Source: verl actor (``pg_loss + kl_loss_coef * agg_loss(kld, response_mask)``)."""
    has_mask = recipe.token_mask != "none" and not mask_selects_tokens(recipe.token_mask)
    return kl_has_own_denominator(recipe.loss, has_mask, recipe.renormalize)


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
      recipe: a :class:`~stapo_jax.algo.recipes.Recipe` (loss, token mask and its scope); its mask strategy comes
        from ``stapo_jax.train.mask_strategy.mask_strategy`` (decided at trace time: it may depend on whether the
        batch has ``old_entropy``).
      optimizer: optax transformation (``stapo_jax.train.optim.make_optimizer``). A
        ``stapo_jax.train.optim.GlobalNormClipped`` one (make_optimizer's with ``clip_grad``) is given the
        step's ``grad_norm`` as the extra argument ``global_norm``; any other is called as optax defines it.
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
      per-micro-batch masks report the mean of the micro-batch thresholds), the strategy's own metrics (S2T
      correction: ``s2t/correction_passes`` / ``s2t/corrected_tokens``), plus ``kl_loss`` / ``entropy_loss`` /
      ``rollout_is_weight`` when active.

    Raises:
      ValueError (at call time): batch fields missing or misshaped, K not dividing B, S2T ``stats_policy=old``
      without ``old_entropy``.
    """
    k, apart = num_micro_batches, kl_apart(recipe)
    # the KL term over every valid token has its own denominator; where it can differ from the kept-token count
    # (known only after the gradient pass) the pass differentiates it apart (``kl_sum``) into a second gradient sum
    surrogate = masked_policy_loss(recipe, fold_kl=not apart)
    loss = recipe.loss

    def kl_sum(lp, mb):
        return kl_loss(lp, mb.ref_log_probs, mb.response_mask, kl_loss_type=loss.kl_loss_type,
                       loss_agg_mode=loss.loss_agg_mode, loss_scale_factor=loss.loss_scale_factor)[0]
    lp_fn = make_log_prob_fn(temperature=temperature, seq_chunk=seq_chunk, vocab_chunk=vocab_chunk,
                             num_micro_batches=k)

    def step(state: TrainState, batch: Batch):
        _validate(batch, k)
        params, graphdef, r = state.params, state.graphdef, batch.response_mask.shape[1]

        def forward(p, mb):  # the one differentiable policy forward: [B/K, R] log-probs and entropy
            return response_log_probs_and_entropy(nnx.merge(graphdef, p), mb.input_ids, mb.attention_mask, r,
                                                  temperature=temperature, seq_chunk=seq_chunk,
                                                  vocab_chunk=vocab_chunk, packing=mb.packing)

        ctx = UpdateContext(recipe=recipe, key=jax.random.fold_in(jax.random.PRNGKey(0), state.step),
                            num_micro_batches=k, forward=forward, surrogate=surrogate, grad=_grad,
                            log_probs=lambda p, b: lp_fn(p, graphdef, b.input_ids, b.attention_mask, r, b.packing))
        strategy = mask_strategy(recipe, has_old_entropy=batch.old_entropy is not None)
        mask_state, per_micro = strategy.prepare(ctx, params, batch)
        mbs = jax.tree.map(lambda x: split_micro_batches(x, k), batch)
        grad_sum, kl_grad_sum, (lps, ents, keeps, taus) = _micro_batch_gradients(
            strategy, ctx, mask_state, params, mbs, per_micro, forward, surrogate, kl_sum if apart else None)
        lp_all, ent_all = join_micro_batches(lps), join_micro_batches(ents)
        out = strategy.finish(FinishInputs(ctx, mask_state, params, grad_sum, lp_all, ent_all, keeps, taus, mbs,
                                           batch))
        # loss value, denominator and metrics on the whole mini-batch with the final mask (stop-gradient inputs);
        # and the token diagnostics from the statistics that defined the mask
        loss_sum, den, m = surrogate(lp_all, ent_all, batch, out.keep)
        loss_value = safe_divide(loss_sum, den)
        if apart:  # the KL term's value over its own denominator (also when no token is kept)
            loss_value = loss_value + loss.kl_loss_coef * safe_divide(*m["kl_loss"])
        m = {**m, **mask_metrics(recipe, out, batch, vocab_size)}
        grads = _mean_gradients(out.grad_sum, den, kl_grad_sum, m["kl_loss"][1] if apart else None,
                                loss.kl_loss_coef)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        new_params, new_opt = _apply_unless_nonfinite(optimizer, grads, grad_norm, finite, params, state.opt_state)
        new_state = state.replace(params=new_params, opt_state=new_opt, step=state.step + finite.astype(jnp.int32))
        return new_state, _step_metrics(m, den, out.metrics, loss_value, grad_norm, finite)

    if mesh is None:
        return jax.jit(step, donate_argnums=(0,) if donate else ())
    if state_shardings is None:
        raise ValueError("make_train_step(mesh=...) needs state_shardings (jax.tree.map(lambda x: x.sharding, state))")
    bs, rep = batch_sharding(mesh), NamedSharding(mesh, P())
    return jax.jit(step, in_shardings=(state_shardings, bs), out_shardings=(state_shardings, rep),
                   donate_argnums=(0,) if donate else ())


def _micro_batch_gradients(strategy, ctx, mask_state, params, mbs, per_micro, forward, surrogate, kl_sum):
    """Scan the K micro-batches: ``(grad_sum, kl_grad_sum, (log_probs, entropy, keep, tau) per micro-batch)``.
    With ``kl_sum`` (the KL term differentiated apart) each micro-batch is one forward and two backward passes,
    the policy gradient's and the KL term's; without it ``kl_grad_sum`` is None."""
    k = ctx.num_micro_batches

    def micro(grad_acc, xs):
        mb, pm, j = xs

        def loss_fn(p):
            lp, ent = forward(p, mb)
            sg_lp, sg_ent = jax.lax.stop_gradient(lp), jax.lax.stop_gradient(ent)
            keep, tau = strategy.micro_mask(ctx, mask_state, pm, sg_lp, sg_ent, mb, j)
            return surrogate(lp, ent, mb, keep)[0], (sg_lp, sg_ent, keep, tau)

        g, out = _grad(loss_fn, params)
        return jax.tree.map(jnp.add, grad_acc, g), out

    def micro_kl_apart(accs, xs):  # one forward, two backward passes: the policy gradient's and the KL term's
        mb, pm, j = xs
        (lp, ent), pull = jax.vjp(lambda p: forward(p, mb), params)
        sg_lp, sg_ent = jax.lax.stop_gradient(lp), jax.lax.stop_gradient(ent)
        keep, tau = strategy.micro_mask(ctx, mask_state, pm, sg_lp, sg_ent, mb, j)
        cot = jax.grad(lambda a, b: surrogate(a, b, mb, keep)[0], argnums=(0, 1))(lp, ent)
        cot_kl = (jax.grad(kl_sum)(lp, mb), jnp.zeros_like(ent))
        g, g_kl = pull(cot)[0], pull(cot_kl)[0]
        return jax.tree.map(jnp.add, accs, (g, g_kl)), (sg_lp, sg_ent, keep, tau)

    zeros = jax.tree.map(jnp.zeros_like, params)
    if kl_sum is not None:
        (grad_sum, kl_grad_sum), outs = jax.lax.scan(micro_kl_apart, (zeros, zeros), (mbs, per_micro, jnp.arange(k)))
        return grad_sum, kl_grad_sum, outs
    grad_sum, outs = jax.lax.scan(micro, zeros, (mbs, per_micro, jnp.arange(k)))
    return grad_sum, None, outs


def _mean_gradients(grad_sum, den, kl_grad_sum, kl_den, kl_loss_coef: float):
    """The gradient of the mean loss: ``grad_sum / den``, plus ``kl_loss_coef * kl_grad_sum / kl_den`` when the KL
    term was differentiated apart (``kl_grad_sum`` not None; float32 trees like the parameters)."""
    # the gradient of the mean is grad_sum / den: one scalar reciprocal and a multiply (a per-element divide
    # was a pass of its own on XLA:CPU). The product stays materialised: it is an operand of the branch below
    # (computing it inside the branch made XLA copy the branch's operands, 8.6 -> 11.9 s per Qwen3-0.6B update,
    # bench/bench_update.py --preset qwen3-0.6b; recomputing it in each of the branch's per-leaf AdamW loops
    # raised that update's XLA temporaries by 470 MiB). make_optimizer's clip-first optimizer gets the norm
    # computed here as ``global_norm`` (optax extra argument), so the clip reads no gradient inside the
    # branch: one pass over the 0.6B gradients fewer, bitwise the same update. Any other optimizer is called
    # as optax defines it (its clip, wherever it sits, computes its own norm): ``optim.update_with_norm``.
    inv_den = safe_divide(jnp.ones((), jnp.float32), den)
    grads = jax.tree.map(lambda g: g * inv_den, grad_sum)  # float32, as g / den was for bf16 gradients
    if kl_grad_sum is not None:  # + kl_loss_coef * grad(KL sum) / (the KL term's own global denominator)
        kl_scale = kl_loss_coef * safe_divide(jnp.ones((), jnp.float32), kl_den)
        grads = jax.tree.map(lambda g, gk: g + gk * kl_scale, grads, kl_grad_sum)
    return grads


def _apply_unless_nonfinite(optimizer, grads, grad_norm, finite, params, opt_state):
    """``(new_params, new_opt_state)``: the optimizer's update, or the old values when the gradient is not finite
    (``finite`` a bool scalar)."""

    def apply(params_and_opt):
        updates, new_opt = update_with_norm(optimizer, grads, params_and_opt[1], params_and_opt[0], grad_norm)
        return optax.apply_updates(params_and_opt[0], updates), new_opt

    updated_types = jax.eval_shape(apply, (params, opt_state))

    def skip(params_and_opt):  # the old values, in the dtypes the update returns (f32 moments of bf16 params)
        return jax.tree.map(lambda old, new: old.astype(new.dtype), params_and_opt, updated_types)

    # a non-finite gradient skips the update: parameters and moments stay as they were (bitwise, up to that
    # dtype). A branch, not a select of new against old values: with the select XLA:CPU copied every moment
    # buffer (the new parameters re-derive the moments from the old ones, which the donated update overwrites)
    return jax.lax.cond(finite, apply, skip, (params, opt_state))


def _step_metrics(m: dict, den, strategy_metrics: dict, loss_value, grad_norm, finite) -> dict:
    """The step's float32 scalar metrics: the loss's ``(sum, weight)`` pairs finalised over ``den``, the counts,
    the mask strategy's own, and ``loss`` / ``loss_denominator`` / ``grad_norm`` / ``nonfinite_grad``."""
    metrics = finalize_metrics(m, den)
    metrics.update({name: m[name][0] for name in count_metrics() if name in m})
    metrics.update(strategy_metrics)
    metrics.update({"loss": loss_value, "loss_denominator": den, "grad_norm": grad_norm,
                    "nonfinite_grad": (~finite).astype(jnp.float32)})
    return metrics

def _grad(fn, params):
    """``(grad of fn's first output w.r.t. params, fn's second output)``: every gradient of the update goes
    through here (the micro-batch pass and the S2T correction)."""
    return jax.grad(fn, has_aux=True)(params)


def make_update_steps(recipe: Recipe, optimizer, **step_kw):
    """``(first_step, step)``: the jitted update (:func:`make_train_step` ``(recipe, optimizer, **step_kw)``) and
    the one to use on the first mini-batch of a training step. They differ only where the mask's update entry gives
    a first-mini-batch recipe (``mask_strategy.first_minibatch_recipe``: S2T with the ``prepass`` mode, where the
    first mini-batch reads the rollout policy's statistics, θ = θ_old there, saving the pre-pass); otherwise both
    are the same function.

    The returned steps take the ``[B, ...]`` :class:`~stapo_jax.train.train_step.Batch` arrays
    (``old_log_probs`` / ``old_entropy`` ``[B, R]`` float32) and return float32 scalar metrics.
    Raises: ValueError as ``make_train_step``. Source: stapo_spec.md §3 (θ = θ_old on the first mini-batch).
    """
    step = make_train_step(recipe, optimizer, **step_kw)
    first = first_minibatch_recipe(recipe)
    return (step if first is None else make_train_step(first, optimizer, **step_kw)), step
