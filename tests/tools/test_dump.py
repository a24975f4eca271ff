"""stapo_jax.tools.dump writes what `stapo-jax check` reads, from a real verl DataProto and a real TRL GRPO loss step;
check then agrees with the numbers verl / TRL computed (and flags a tampered one)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from verl import DataProto
from verl.trainer.ppo import core_algos

from fixtures_peers import policy_inputs, trl_loss_and_grad, trl_trainer_view, verl_actor_config

from stapo_jax.tools.check import load_dump_settings, main as check_main
from stapo_jax.tools.dump import (SETTINGS_METADATA_KEY, TRL_LOSS_AGG_MODES, dump_trl_step, dump_verl_batch,
                                  group_ids_from_uids, trl_loss_settings)

B, T = 6, 7  # rows and response tokens of the dumped steps


def test_group_ids_from_uids_keeps_first_appearance_order():
    assert group_ids_from_uids(np.array(["b", "a", "b", "c"], dtype=object)).tolist() == [0, 1, 0, 2]


def test_verl_dataproto_dump_is_checked(tmp_path, capsys):
    lp, old, _, mask = policy_inputs(12, B, T, empty_row=False)
    uids = np.array(["p0", "p1", "p0", "p1", "p2", "p2"], dtype=object)
    rewards = np.zeros_like(mask)
    rewards[:, -1] = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    adv, _ = core_algos.compute_grpo_outcome_advantage(torch.tensor(rewards), torch.tensor(mask), uids)
    data = DataProto.from_dict(tensors={"old_log_probs": torch.tensor(old), "advantages": adv,
                                        "response_mask": torch.tensor(mask), "token_level_rewards": torch.tensor(rewards)},
                               non_tensors={"uid": uids})
    cfg = verl_actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    pg_loss, pg_metrics = core_algos.compute_policy_loss_vanilla(torch.tensor(old), torch.tensor(lp), adv,
                                                                 torch.tensor(mask), loss_agg_mode="token-mean",
                                                                 config=cfg)
    path = str(tmp_path / "verl.safetensors")
    dump_verl_batch(data, path, log_probs=torch.tensor(lp), metrics={"actor/pg_loss": pg_loss.item(), **pg_metrics},
                    actor_config=cfg)
    settings = load_dump_settings(path)  # verl's own values travel with the dump (clip_ratio_c: verl's 3.0)
    assert {k: settings[k] for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode")} == {
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean"}
    assert settings["kl_loss_coef"] == cfg.kl_loss_coef and settings["use_kl_loss"] is False
    fields = load_file(path)
    assert {"old_log_probs", "log_probs", "advantages", "response_mask", "rewards", "group_ids",
            "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac"} <= set(fields)
    args = [path, "--recipe", "grpo", "--atol", "1e-5"]  # no loss flags: the dump's settings, not grpo's 0.2 / 10
    assert check_main(args) == 0
    out = capsys.readouterr().out
    assert "pg_loss" in out and "advantages" in out and "pg_clipfrac" in out
    assert "clip_ratio_high=0.28 clip_ratio_c=3.0 (from the dump:" in out
    assert check_main(args + ["--clip-ratio-high", "0.2"]) == 1  # a flag wins over the dump (and is wrong here)
    fields["actor/pg_loss"] = np.asarray(fields["actor/pg_loss"] + 1e-3, np.float32)  # a wrong report is caught
    save_file(fields, path, metadata={SETTINGS_METADATA_KEY: json.dumps(settings)})
    assert check_main(args) == 1


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dr_grpo"])
def test_trl_step_dump_is_checked(tmp_path, loss_type):
    """TRL's loss settings travel with the dump (trainer=...): check needs no loss flag for any loss_type."""
    lp, old, adv, mask = policy_inputs(13, B, T, empty_row=False)
    ent = np.abs(np.random.default_rng(14).normal(size=lp.shape))
    view = trl_trainer_view(loss_type, max_completion_length=T)
    loss, _ = trl_loss_and_grad(view, lp, old, adv, mask, ent)
    inputs = {"completion_mask": torch.tensor(mask), "advantages": torch.tensor(adv[:, 0]),
              "old_per_token_logps": torch.tensor(old)}
    path = str(tmp_path / "trl.safetensors")
    dump_trl_step(inputs, torch.tensor(lp), path, entropy=torch.tensor(ent), metrics={"loss": loss}, trainer=view)
    settings = load_dump_settings(path)
    assert (settings["clip_ratio_c"], settings["clip_ratio_high"], settings["loss_agg_mode"]) == (
        None, 0.28, TRL_LOSS_AGG_MODES[loss_type])
    args = [path, "--recipe", "grpo", "--atol", "1e-5"]
    assert check_main(args) == 0
    fields = load_file(path)
    fields["loss"] = np.asarray(fields["loss"] * 1.01, np.float32)
    save_file(fields, path, metadata={SETTINGS_METADATA_KEY: json.dumps(settings)})
    assert check_main(args) == 1


def test_trl_settings_without_a_counterpart_are_refused():
    view = trl_trainer_view("cispo", max_completion_length=T)
    with pytest.raises(ValueError, match="loss_type='cispo'"):
        trl_loss_settings(view)
    view = trl_trainer_view("bnpo", max_completion_length=T)
    view.args.delta = 2.0
    with pytest.raises(ValueError, match="delta"):
        trl_loss_settings(view)
