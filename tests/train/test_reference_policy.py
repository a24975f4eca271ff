"""``actor.use_kl_loss`` in ``stapo-jax train``: the KL term's reference policy is the policy RL starts from (after
the SFT warm-up; verl's ``ref`` worker holds the initial actor). Its log-probs come from the trainer's own
log-prob program, it is checkpointed with the train state, and a resumed run keeps the first start's reference:
U runs 3 RL steps; R runs 2, then is restarted with ``trainer.total_steps=3``; R's step 3 equals U's. Resuming
with the other ``actor.use_kl_loss`` is one error line naming the key."""
from __future__ import annotations

import numpy as np

from fixtures_trainer import (flat_arrays, load_safetensors_dir, max_abs_diff, metrics_by_step, restore_raw,
                              run_cli, start_cli, write_config)

KL = {"use_kl_loss": True, "kl_loss_coef": 1.0, "kl_loss_type": "low_var_kl",
      "ppo_mini_batch_size": 4}  # one mini-batch per step: step 1's policy is the reference itself
GRPO_WITH_KL = {"recipe": "grpo", "strict_recipe": False}  # the recipes the project ships have no KL term


def test_kl_reference_is_the_starting_policy_and_survives_a_resume(tmp_path):
    cfgs = {name: write_config(tmp_path / f"{name}.yaml", tmp_path / name, actor=KL, algorithm=GRPO_WITH_KL,
                               trainer={"total_steps": steps, "save_every": 1})
            for name, steps in (("U", 3), ("R", 2))}
    u = start_cli("train", "--config", str(cfgs["U"]), log_path=tmp_path / "U.log")
    r = run_cli("train", "--config", str(cfgs["R"]))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert u.wait(900) == 0, (tmp_path / "U.log").read_text()[-4000:]
    r = run_cli("train", "--config", str(cfgs["R"]), "trainer.total_steps=3")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from step 2" in r.stdout + r.stderr

    rows_u, rows_r = metrics_by_step(tmp_path / "U"), metrics_by_step(tmp_path / "R")
    assert rows_u[1]["kl_loss"] == 0.0  # the first update's policy is the reference: identical log-probs
    assert rows_u[1]["reward/mean"] > 0 and rows_u[2]["kl_loss"] > 1e-6 and rows_u[3]["kl_loss"] > 1e-6
    # a reference re-taken at the restart would give 0 here, as in step 1
    np.testing.assert_allclose(rows_r[3]["kl_loss"], rows_u[3]["kl_loss"], rtol=1e-5, atol=1e-7)
    for key in ("loss", "grad_norm", "reward/mean"):
        np.testing.assert_allclose(rows_r[3][key], rows_u[3][key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert max_abs_diff(load_safetensors_dir(tmp_path / "R" / "hf"), load_safetensors_dir(tmp_path / "U" / "hf")) \
        <= 1e-6

    # the checkpoints hold the reference next to the state; it does not move while the policy does
    ckpt = tmp_path / "U" / "checkpoints"
    (s1, _, _), (s3, _, _) = restore_raw(ckpt, 1), restore_raw(ckpt, 3)
    ref1, ref3 = flat_arrays(s1["ref"]), flat_arrays(s3["ref"])
    assert sorted(ref1) == sorted(flat_arrays(s1["train"]["params"])) and len(ref1) >= 5
    assert max_abs_diff(ref1, ref3) == 0.0
    assert max_abs_diff(ref3, flat_arrays(s3["train"]["params"])) > 1e-6

    # resuming with the KL term turned off: one line naming the key and the ways on, nothing restored or run
    r = run_cli("train", "--config", str(cfgs["U"]), "trainer.total_steps=4", "actor.use_kl_loss=false")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "actor.use_kl_loss=false, but the checkpoint of step 3" in r.stderr, r.stderr[-2000:]
    assert "written with a KL reference policy" in r.stderr and "trainer.resume=false" in r.stderr
    assert sorted(metrics_by_step(tmp_path / "U")) == [1, 2, 3]
