"""``stapo-jax check`` end to end on dumps produced by the PyTorch reference (safetensors and npz)."""

import os
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import torch_reference as ref  # noqa: E402

from stapo_jax.tools.check import main  # noqa: E402


def torch_dump(recipe_kw, seed=0):
    rng = np.random.default_rng(seed)
    b, t, v = 8, 10, 30
    logits = torch.tensor(rng.normal(size=(b, t, v)) * 4, dtype=torch.float32)
    ids = torch.tensor(rng.integers(0, v, (b, t)))
    resp = torch.tensor(np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None], dtype=torch.float32)
    rewards = torch.tensor(rng.choice([0.0, 1.0], b), dtype=torch.float32)
    group_ids = np.repeat(np.arange(2), 4)
    adv = ref.grpo_advantage(rewards, list(group_ids))
    lp = ref.logprobs_from_logits(logits, ids)
    ent = ref.entropy_from_logits(logits)
    old = lp + torch.tensor(rng.normal(size=(b, t)) * 0.3, dtype=torch.float32)
    loss, keep, metrics = ref.recipe_loss(logits, ids, old, adv, resp, **recipe_kw)
    d = {"log_probs": lp, "old_log_probs": old, "advantages": adv, "response_mask": resp, "entropy": ent,
         "rewards": rewards, "group_ids": torch.tensor(group_ids, dtype=torch.int32), "actor/pg_loss": loss,
         "actor/pg_clipfrac": metrics["pg_clipfrac"], "actor/ppo_kl": metrics["ppo_kl"],
         "actor/pg_clipfrac_lower": metrics["pg_clipfrac_lower"],
         "s2t/masked_frac": 1 - keep.float().sum() / resp.sum()}
    return {k: ref.to_numpy(v) for k, v in d.items()}


STAPO = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0, loss_agg_mode="token-mean",
             token_mask="s2t", tau_p=0.01)


def test_check_passes_on_torch_dump_safetensors_and_npz(tmp_path, capsys):
    d = torch_dump(STAPO)
    assert d["s2t/masked_frac"] > 0
    st = str(tmp_path / "dump.safetensors")
    save_file(d, st)
    assert main([st, "--recipe", "stapo", "--tau-p", "0.01"]) == 0
    out = capsys.readouterr().out
    for name in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "advantages", "s2t/masked_frac", "PASS"):
        assert name in out
    npz = str(tmp_path / "dump.npz")
    np.savez(npz, **d)
    assert main([npz, "--recipe", "stapo", "--tau-p", "0.01"]) == 0


def test_check_seq_mode_and_failure_beyond_tolerance(tmp_path, capsys):
    kw = dict(STAPO, loss_agg_mode="seq-mean-token-mean", token_mask="none", clip_ratio_c=3.0)
    d = torch_dump(kw, seed=1)
    path = str(tmp_path / "d.npz")
    np.savez(path, **d)
    assert main([path, "--recipe", "justrl", "--loss-agg-mode", "seq-mean-token-mean", "--clip-ratio-c", "3"]) == 0
    # with the wrong aggregation mode the loss no longer matches
    assert main([path, "--recipe", "justrl", "--clip-ratio-c", "3"]) == 1
    assert "FAIL" in capsys.readouterr().out
    d["actor/pg_loss"] = d["actor/pg_loss"] + 1e-3
    np.savez(path, **d)
    assert main([path, "--recipe", "justrl", "--loss-agg-mode", "seq-mean-token-mean", "--clip-ratio-c", "3"]) == 1


@pytest.mark.parametrize("drop,reshape,message", [
    ("old_log_probs", None, "missing field 'old_log_probs'"),
    ("log_probs", None, "missing field 'log_probs'"),
    (None, "response_mask", "field 'response_mask' has shape"),
    (None, "advantages", "field 'advantages' has shape"),
])
def test_check_names_missing_or_misshaped_field(tmp_path, capsys, drop, reshape, message):
    d = torch_dump(STAPO)
    if drop:
        d.pop(drop)
    if reshape:
        d[reshape] = d[reshape][:, :3] if d[reshape].ndim == 2 else d[reshape][:3]
    path = str(tmp_path / "bad.npz")
    np.savez(path, **d)
    assert main([path, "--recipe", "stapo"]) == 2
    assert message in capsys.readouterr().err
    assert main([str(tmp_path / "nope.npz")]) == 2


@pytest.mark.parametrize("settings,message", [
    ({"clip_ratio_low": "abc"}, "stapo_jax.loss_settings.clip_ratio_low: expected float, got str 'abc'"),
    ({"clip_ratio_low": None}, "stapo_jax.loss_settings.clip_ratio_low: expected float, got NoneType"),
    ({"clip_ratio_high": [0.28]}, "stapo_jax.loss_settings.clip_ratio_high: expected float, got list"),
    ({"use_kl_loss": "yes"}, "stapo_jax.loss_settings.use_kl_loss: expected bool, got str 'yes'"),
    ({"loss_agg_mode": "token_mean"}, "stapo_jax.loss_settings.loss_agg_mode: 'token_mean' is not one of"),
])
def test_check_names_a_mistyped_dump_setting(tmp_path, capsys, settings, message):
    """Metadata values of the wrong type were a TypeError traceback (``0 <= 'abc'``); now exit 2 naming the key."""
    import json

    from stapo_jax.tools.dump import SETTINGS_METADATA_KEY

    path = str(tmp_path / "d.safetensors")
    save_file(torch_dump(STAPO), path, metadata={SETTINGS_METADATA_KEY: json.dumps(settings)})
    assert main([path, "--recipe", "stapo"]) == 2
    err = capsys.readouterr().err
    assert "d.safetensors: metadata " in err and message in err


def test_check_says_an_out_of_range_setting_came_from_the_dump(tmp_path, capsys):
    import json

    from stapo_jax.tools.dump import SETTINGS_METADATA_KEY

    path = str(tmp_path / "d.safetensors")
    save_file(torch_dump(STAPO), path, metadata={SETTINGS_METADATA_KEY: json.dumps({"clip_ratio_low": 1.5})})
    assert main([path, "--recipe", "stapo"]) == 2
    err = capsys.readouterr().err
    assert "actor.clip_ratio_low=1.5 must be in [0, 1)" in err and "from the dump's metadata" in err


def test_check_rejects_bad_tolerances_fractional_group_ids_and_a_directory(tmp_path, capsys):
    d = torch_dump(STAPO)
    path = str(tmp_path / "d.npz")
    np.savez(path, **d)
    assert main([path, "--atol", "nan"]) == 2
    assert "--atol=nan must be a finite number >= 0" in capsys.readouterr().err
    assert main([path, "--rtol", "-1"]) == 2
    assert "--rtol=-1.0 must be a finite number >= 0" in capsys.readouterr().err
    d["group_ids"] = d["group_ids"].astype(np.float32) + 0.5  # was truncated to int silently
    np.savez(path, **d)
    assert main([path, "--tau-p", "0.01"]) == 2
    assert "field 'group_ids' must hold integer group indices" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("recipe", ["grpo", "dapo", "entropy20", "justrl", "stapo"])
def test_entropy_is_optional_in_every_recipe(tmp_path, capsys, recipe):
    """A dump without ``entropy`` (an optional field) is checked under every recipe: a mask that reads entropy is
    not applied, and the last line says so; no field is reported missing."""
    d = torch_dump(dict(STAPO, token_mask="none"))  # a GRPO-like run: no token mask
    d.pop("entropy")
    path = str(tmp_path / "no_entropy.npz")
    np.savez(path, **d)
    assert main([path, "--recipe", recipe, "--clip-ratio-high", "0.28"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "PASS" in out and "pg_loss" in out and "advantages" in out
    masked = recipe in ("entropy20", "stapo")
    note = f"token_mask={'top_entropy' if recipe == 'entropy20' else 's2t'} not applied: the dump has no 'entropy'"
    assert (out.strip().splitlines()[-1].startswith(note)) == masked, out


def test_a_present_field_is_never_reported_missing(tmp_path, capsys):
    """Only the four required fields: nothing to compare (advantages need rewards + group_ids to be recomputed);
    the error names what is missing for a comparison and lists the fields the dump holds."""
    d = {k: v for k, v in torch_dump(STAPO).items() if k in ("old_log_probs", "log_probs", "advantages",
                                                                "response_mask")}
    path = str(tmp_path / "inputs_only.npz")
    np.savez(path, **d)
    assert main([path, "--recipe", "grpo"]) == 2
    err = capsys.readouterr().err
    assert "nothing to compare" in err and "no 'rewards' + 'group_ids' to recompute its 'advantages'" in err
    assert "(it holds: ['advantages', 'log_probs', 'old_log_probs', 'response_mask'])" in err
    assert "missing" not in err
