"""The optimizer of every update in this project: optax AdamW with linear warm-up, constant afterwards
(stapo_spec §4: lr 1e-6, 10 warm-up steps), optional global-norm clipping (JustRL: 1.0)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from stapo_jax.config.schema import Config


def make_optimizer(lr: float, warmup_steps: int = 0, weight_decay: float = 0.0, clip_grad: Optional[float] = None,
                   betas: Sequence[float] = (0.9, 0.999), eps: float = 1e-8) -> optax.GradientTransformation:
    """AdamW(lr schedule, betas, eps, weight_decay) preceded by ``clip_by_global_norm(clip_grad)`` when set.

    Args:
      lr: peak learning rate (> 0).
      warmup_steps: optimizer steps of linear warm-up from 0 to ``lr`` (>= 0); constant afterwards.
      weight_decay: decoupled weight decay (AdamW), applied to every parameter as verl's FSDP actor does.
      clip_grad: global-norm clip threshold, or None for no clipping.
    Raises:
      ValueError: non-positive ``lr``, negative ``warmup_steps`` or non-positive ``clip_grad``.
    Takes Python floats/ints; the returned transformation keeps the parameters' dtypes (float32 moments
    for float32 parameters).
    """
    if lr <= 0:
        raise ValueError(f"optim.lr={lr} must be > 0")
    if warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps={warmup_steps} must be >= 0")
    if clip_grad is not None and clip_grad <= 0:
        raise ValueError(f"optim.clip_grad={clip_grad} must be > 0 or null")
    # lr * min(1, step / warmup_steps): verl's / transformers' constant schedule with warm-up
    schedule = optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps else optax.constant_schedule(lr)
    adamw = optax.adamw(schedule, b1=betas[0], b2=betas[1], eps=eps, weight_decay=weight_decay)
    if clip_grad is None:
        return adamw
    chain = optax.chain(clip_by_global_norm(clip_grad), adamw)
    return GlobalNormClipped(chain.init, chain.update)


class GlobalNormClipped(optax.GradientTransformationExtraArgs):
    """An optax optimizer whose first transformation is :func:`clip_by_global_norm`, so its ``update`` may be
    given ``global_norm=`` (the norm of the gradient it receives) and then reads no gradient for the clip.
    :func:`make_optimizer` returns one when ``clip_grad`` is set; ``stapo_jax.train.train_step`` passes the norm
    only to this type (a user chain with a transformation before the clip, or the clip in one group of
    ``optax.multi_transform``, would need another norm). Otherwise an ordinary optax transformation (the same
    ``init`` / ``update`` and state). Holds no state of its own; never raises. Source: optax's extra-argument
    protocol (``GradientTransformationExtraArgs``)."""


def update_with_norm(optimizer: optax.GradientTransformation, grads, opt_state, params, grad_norm: jax.Array):
    """``optimizer.update(grads, opt_state, params)``, giving a :class:`GlobalNormClipped` optimizer the norm the
    caller already computed (``global_norm=grad_norm``) so its clip reads no gradient; any other optimizer is
    called as optax defines it. The one place that decides it (the RL train step and the SFT step call it).

    Args: ``grads`` / ``params`` pytrees of float arrays (same structure), ``opt_state`` the optimizer's state,
    ``grad_norm`` a scalar: ``optax.tree.norm(grads)``. Returns ``(updates, new_opt_state)``.
    Raises what ``optimizer.update`` raises. Source: optax's extra-argument protocol."""
    extra = {"global_norm": grad_norm} if isinstance(optimizer, GlobalNormClipped) else {}
    return optimizer.update(grads, opt_state, params, **extra)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm(max_norm)`` as one scalar factor: every update is multiplied by
    ``max_norm / norm`` when the global norm is at least ``max_norm`` and left bitwise as it is below it.

    The same state (``optax.EmptyState``, so checkpoints and ``opt_state`` trees are unchanged) and the same
    updates up to one rounding (``t * (max_norm / norm)`` instead of optax's ``(t / norm) * max_norm``). The
    reason is speed: XLA:CPU keeps optax's per-element divide as its own pass that writes every clipped
    gradient, while a multiply by a scalar is fused into the Adam moment updates that read the gradient
    (2.1 s of an 11.5 s Qwen3-0.6B update, ``bench/bench_update.py --preset qwen3-0.6b``).

    ``update(updates, state, params=None, *, global_norm=None)``: a caller that already holds the global norm
    of ``updates`` (a scalar, as ``optax.tree.norm(updates)`` gives it: the update's ``grad_norm`` metric) passes it as the extra argument
    ``global_norm`` (``optax.chain`` forwards extra arguments), and the clip then reads no gradient itself: one
    pass over all gradients fewer inside the update (``stapo_jax.train.train_step``, for a
    :class:`GlobalNormClipped` optimizer). It must be the norm of the ``updates`` this transformation receives
    (first in :func:`make_optimizer`'s chain). Without it the norm is computed here, as optax does.
    Shapes / dtypes: any pytree of float arrays; the factor is cast to each leaf's dtype. Raises: nothing of its
    own (``max_norm`` > 0 is checked by :func:`make_optimizer`). Source: optax ``clip_by_global_norm``
    (Pascanu et al., 2012).
    """

    def update_fn(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        g_norm = optax.tree.norm(updates) if global_norm is None else jnp.asarray(global_norm)
        factor = jnp.where(g_norm < max_norm, jnp.ones_like(g_norm), max_norm / g_norm)
        return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


@jax.jit
def all_finite(tree) -> jax.Array:
    """Scalar bool array: every element of every leaf of ``tree`` (e.g. the parameters) is finite.
    Never raises. Source: the nonfinite-gradient guard of verl's actor (skip the update)."""
    return jnp.all(jnp.stack([jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]))


def build_optimizer(cfg: Config):
    """AdamW with warm-up and clipping from ``actor.optim`` (:func:`make_optimizer`).
    Takes Python floats; the optimizer keeps the parameters' dtypes. Raises: ValueError as
    ``make_optimizer``. Source: ``stapo_jax.train.optim.make_optimizer`` (verl's ``actor.optim`` keys)."""
    return make_optimizer(**dataclasses.asdict(cfg.actor.optim))  # its fields are make_optimizer's keywords
