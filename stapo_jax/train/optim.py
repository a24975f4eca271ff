"""The optimizer of every update in this project: optax AdamW with linear warm-up, constant afterwards
(stapo_spec §4: lr 1e-6, 10 warm-up steps), optional global-norm clipping (JustRL: 1.0)."""
from __future__ import annotations

from typing import Optional, Sequence

import optax


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
    Takes Python floats/ints (no arrays); the returned transformation keeps the parameters' dtypes (float32 moments
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
    return optax.chain(optax.clip_by_global_norm(clip_grad), adamw)
