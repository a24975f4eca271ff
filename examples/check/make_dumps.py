"""Write the two example dumps of ``stapo-jax check`` with the real peers (verl 0.9.1, TRL 1.16; installed by
``make setup-test``, ``requirements-peers.txt``):

* ``verl_grpo_step.safetensors``: one GRPO mini-batch as verl's actor update sees it (a ``DataProto`` with
  ``old_log_probs``, ``advantages`` from verl's ``compute_grpo_outcome_advantage``, ``response_mask``,
  ``token_level_rewards`` and the prompts' ``uid``), the current ``log_probs`` and ``entropy``, the metrics of
  verl's ``compute_policy_loss_vanilla`` and verl's actor config (dual clip ``clip_ratio_c`` = 3.0, verl's
  default) in the metadata: ``stapo_jax.tools.dump.dump_verl_batch``;
* ``trl_grpo_step.safetensors``: one step of TRL's ``GRPOTrainer._compute_loss`` (``loss_type="dapo"``, TRL's
  default; no ``entropy`` saved: it is optional), its loss and TRL's settings in the metadata:
  ``stapo_jax.tools.dump.dump_trl_step``.

The policy is a fixed random one over a 50-token vocabulary: 2 prompts x 4 responses of at most 12 tokens,
rewards 0/1. Run from the repository root (the files are committed; ``tests/project/test_readme_outputs.py`` checks the
the ``check`` output docs/check.md quotes on them)::

    .venv/bin/python examples/check/make_dumps.py
"""
from __future__ import annotations

import collections
import functools
import types
from pathlib import Path

import numpy as np
import torch

from stapo_jax.tools.dump import dump_trl_step, dump_verl_batch

HERE = Path(__file__).resolve().parent
B, T, V, GROUP = 8, 12, 50, 4


def policy_batch(seed: int):
    """Log-probs and entropies of sampled tokens under a random policy, an older policy's log-probs, a response
    mask and 0/1 outcome rewards (torch float32)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    logp_all = torch.log_softmax(logits, -1)
    ids = torch.multinomial(logp_all.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    log_probs = logp_all.gather(-1, ids[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    old_log_probs = log_probs + 0.3 * torch.randn(B, T, generator=g)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    return log_probs, entropy, old_log_probs, mask, rewards


def make_verl(path: Path) -> None:
    """verl 0.9.1: GRPO advantages and the vanilla policy loss of one mini-batch, dumped from its ``DataProto``."""
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.workers.config.actor import ActorConfig

    log_probs, entropy, old, mask, rewards = policy_batch(0)
    token_rewards = torch.zeros(B, T)
    token_rewards[torch.arange(B), mask.sum(-1).long() - 1] = rewards  # the outcome reward on the last token
    uid = np.array([f"prompt-{i // GROUP}" for i in range(B)], dtype=object)
    advantages, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, uid)
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=GROUP, ppo_mini_batch_size=2,
                         clip_ratio_low=0.2, clip_ratio_high=0.28)
    pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(old, log_probs, advantages, mask,
                                                                 loss_agg_mode="token-mean", config=config)
    data = DataProto.from_dict(tensors={"old_log_probs": old, "advantages": advantages, "response_mask": mask,
                                        "token_level_rewards": token_rewards}, non_tensors={"uid": uid})
    metrics = {"actor/pg_loss": pg_loss.item(), **{k: float(v) for k, v in pg_metrics.items()}}
    dump_verl_batch(data, str(path), log_probs=log_probs, entropy=entropy, metrics=metrics, actor_config=config)


def make_trl(path: Path) -> None:
    """TRL 1.16: ``GRPOTrainer._compute_loss`` on one step, around the real method and a real ``Accelerator``
    (the model forward replaced by the batch's log-probs: no model is loaded)."""
    from accelerate import Accelerator
    from trl.trainer.grpo_trainer import GRPOTrainer

    log_probs, entropy, old, mask, rewards = policy_batch(1)
    grouped = rewards.reshape(-1, GROUP)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    trainer = types.SimpleNamespace(  # the attributes _compute_loss reads (TRL's GRPOConfig defaults)
        loss_type="dapo", beta=0.0, top_entropy_quantile=1.0, epsilon_low=0.2, epsilon_high=0.28,
        importance_sampling_level="token", off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, max_completion_length=T, model=types.SimpleNamespace(training=True),
        accelerator=Accelerator(cpu=True),
        args=types.SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)})
    trainer.get_high_entropy_mask = functools.partial(GRPOTrainer.get_high_entropy_mask, trainer)
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (log_probs, entropy, None)
    inputs = {"prompt_ids": torch.zeros((B, 2), dtype=torch.long), "prompt_mask": torch.ones((B, 2)),
              "completion_ids": torch.zeros((B, T), dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    dump_trl_step(inputs, log_probs, str(path), metrics={"loss": loss.item()}, trainer=trainer)


if __name__ == "__main__":
    make_verl(HERE / "verl_grpo_step.safetensors")
    make_trl(HERE / "trl_grpo_step.safetensors")
    print("wrote", HERE / "verl_grpo_step.safetensors", "and", HERE / "trl_grpo_step.safetensors")
