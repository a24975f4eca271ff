"""The real peers' side of the parity tests: verl 0.9.1's actor config and TRL 1.16's ``GRPOTrainer._compute_loss``
called as the installed packages define them, with the model forward replaced by given log-probs; and the
ragged float64 policy-loss inputs the parity tests share (tests/algo/test_peer_parity.py, test_kl_token_mask_parity.py,
test_gspo.py, tests/tools/test_dump.py)."""
from __future__ import annotations

import collections
import functools
import types
from typing import Optional

import numpy as np
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from verl.workers.config.actor import ActorConfig


def policy_inputs(seed: int, b: int = 6, t: int = 7, empty_row: bool = True):
    """Ragged float64 ``(log_probs, old_log_probs, advantages, response_mask)``, each ``[b, t]``: lengths 1..t,
    row 2 empty when ``empty_row``, log-probs around -1.5, old log-probs within ~0.3, one advantage per row."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    if empty_row:
        mask[2] = 0.0
    lp = rng.normal(size=(b, t)) * 0.6 - 1.5
    old = lp + rng.normal(size=(b, t)) * 0.3
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1)
    return lp, old, adv, mask


def verl_actor_config(**kw) -> ActorConfig:
    """verl's ``ActorConfig`` for one process and one micro-batch, with the given loss fields (``clip_ratio_low``,
    ``loss_agg_mode``, ``use_kl_loss``, ...)."""
    return ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, ppo_mini_batch_size=1, **kw)


def trl_trainer_view(loss_type: str, *, max_completion_length: int, beta: float = 0.0,
                     top_entropy_quantile: float = 1.0) -> types.SimpleNamespace:
    """The attributes ``GRPOTrainer._compute_loss`` reads (clip 0.2 / 0.28, token-level ratios, no vLLM), around
    the real method and a real one-process ``Accelerator``."""
    from accelerate import Accelerator

    view = types.SimpleNamespace(
        loss_type=loss_type, beta=beta, top_entropy_quantile=top_entropy_quantile, epsilon_low=0.2,
        epsilon_high=0.28, importance_sampling_level="token", off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, max_completion_length=max_completion_length,
        model=types.SimpleNamespace(training=True), accelerator=Accelerator(cpu=True),
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
    )
    view.get_high_entropy_mask = functools.partial(GRPOTrainer.get_high_entropy_mask, view)
    return view


def trl_loss_and_grad(view, lp, old, adv, mask, ent, ref: Optional[np.ndarray] = None) -> tuple[float, np.ndarray]:
    """TRL's GRPO loss over float64 ``[B, T]`` log-probs (``lp``), old log-probs, response mask, entropies and
    optional reference log-probs, with advantages ``adv[:, 0]`` (one per row); returns the loss and its
    gradient w.r.t. ``lp``, ``[B, T]``."""
    b, t = lp.shape
    t_lp = torch.tensor(lp, requires_grad=True)
    view._get_per_token_logps_and_entropies = lambda *a, **k: (t_lp, torch.tensor(ent), None)
    inputs = {"prompt_ids": torch.zeros((b, 2), dtype=torch.long), "prompt_mask": torch.ones((b, 2)),
              "completion_ids": torch.zeros((b, t), dtype=torch.long), "completion_mask": torch.tensor(mask),
              "advantages": torch.tensor(adv[:, 0]), "old_per_token_logps": torch.tensor(old),
              "num_items_in_batch": torch.tensor(mask.sum())}
    if ref is not None:
        inputs["ref_per_token_logps"] = torch.tensor(ref)
    loss = GRPOTrainer._compute_loss(view, None, inputs)
    loss.backward()
    return float(loss.detach()), t_lp.grad.numpy()
