"""End to end: ``stapo-jax train`` (SFT warm-up then 3 STAPO steps of a tiny Qwen3 on reasoning-gym sums, on a
2-device data-parallel mesh), ``stapo-jax sft``, ``stapo-jax plot`` and the command line's config/data errors,
each in a child process as a user runs them (issue 5, "Tests").

What the run leaves is checked against independent readers: metrics rows (JSON), TensorBoard events
(tensorboard's EventAccumulator), Orbax checkpoints (restored without a target), PNGs (matplotlib), the HF
export (transformers' PyTorch ``Qwen3ForCausalLM``: its logits equal our model's with the final checkpoint's
parameters), the resolved config (``load_config``).
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fixtures_trainer import (TINY_CONFIG, committed_steps, flat_arrays, max_abs_diff, metric_rows, restore_raw,
                              run_cli, start_cli, write_config)

from stapo_jax.runtime.allocator import find_tcmalloc

STEPS = 3
DEVICES = 2
OVERRIDE = "actor.clip_ratio_high=0.25"   # a command-line override, to be found in the saved config
REQUIRED_KEYS = (
    "reward/mean", "reward/score_mean", "acc/mean", "entropy", "s2t/masked_frac", "s2t/tau_h", "pg_clipfrac",
    "pg_clipfrac_lower", "ppo_kl", "grad_norm", "loss", "pg_loss", "response_length/mean",
    "response_length/clip_frac", "advantages/mean", "reward/n_timeout", "reward/n_error", "reward/n_unparsed",
    "time/rollout", "time/reward", "time/update", "time/sync", "time/step", "perf/tokens_per_s",
    "sampler_trainer/logp_diff_mean", "sampler_trainer/logp_diff_max")
PLOTS = ("reward_mean.png", "entropy.png", "s2t_masked_frac.png", "response_length_mean.png", "acc_mean.png",
         "pg_clipfrac.png", "pg_clipfrac_lower.png", "val_acc.png", "curves.png")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One RL run (train) and one SFT-only run (sft), started together."""
    tmp = tmp_path_factory.mktemp("e2e")
    run_dir = tmp / "run"
    cfg = write_config(tmp / "tiny.yaml", run_dir, trainer={"total_steps": STEPS, "save_every": 1,
                                                              "keep_checkpoints": 2})
    sft_dir = tmp / "sft_run"
    sft_cfg = write_config(tmp / "sft.yaml", sft_dir, sft={"steps": 40})
    train_log, sft_log = tmp / "train.log", tmp / "sft.log"
    train = start_cli("train", "--config", str(cfg), OVERRIDE, log_path=train_log, devices=DEVICES)
    sft = start_cli("sft", "--config", str(sft_cfg), log_path=sft_log, devices=1)
    try:
        train_rc, sft_rc = train.wait(1200), sft.wait(1200)
    finally:
        for p in (train, sft):
            if p.poll() is None:
                p.kill()
                p.wait()
    return {"run_dir": run_dir, "cfg": cfg, "rc": train_rc, "log": train_log.read_text(),
            "sft_dir": sft_dir, "sft_cfg": sft_cfg, "sft_rc": sft_rc, "sft_log": sft_log.read_text()}


@pytest.fixture(scope="module")
def run(runs):
    assert runs["rc"] == 0, runs["log"][-4000:]
    return runs


def test_console_output(run):
    out = run["log"]
    assert re.search(r"SFT warm-up: 100 steps, loss [\d.]+ -> [\d.]+", out)
    # the CLI re-executed itself under TCMalloc where this machine has it (else the system allocator) and says so
    mode = os.environ.get("STAPO_JAX_ALLOCATOR") or "auto"
    expected = "tcmalloc" if mode != "system" and find_tcmalloc() else "system"
    allocator = re.search(r"host allocator: (\w+) \(STAPO_JAX_ALLOCATOR=(\w+);", out)
    assert allocator and allocator.groups() == (expected, mode), out[:3000]
    before = float(re.search(r"heldout_acc_before: ([\d.]+)", out).group(1))
    after = float(re.search(r"heldout_acc_after: ([\d.]+)", out).group(1))
    assert 0.0 <= before <= 1.0 and 0.0 <= after <= 1.0
    assert f"hf_export: {run['run_dir'] / 'hf'}" in out
    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    assert summary["heldout_acc_before"] == before and summary["heldout_acc_after"] == after
    assert summary["hf_export"] == str(run["run_dir"] / "hf")


def test_metrics_rows(run):
    rows = metric_rows(run["run_dir"])
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, missing
        assert all(v is not None and math.isfinite(v) for v in r.values()), r
        assert r["time/rollout"] > 0 and r["time/update"] > 0 and r["time/sync"] >= 0 and r["time/step"] > 0
        assert r["time/step"] >= r["time/update"]
        assert 0 <= r["acc/mean"] <= r["reward/mean"] <= 1      # basic_arithmetic gives partial credit, never more
        assert r["reward/n_timeout"] == 0 and r["reward/n_error"] == 0
        assert r["sampling/prompts"] == TINY_CONFIG["trainer"]["train_batch_size"]
        assert 0 <= r["s2t/masked_frac"] <= 1 and 0 <= r["pg_clipfrac"] <= 1
        assert 1 <= r["response_length/mean"] <= TINY_CONFIG["rollout"]["max_new_tokens"]
        assert r["grad_norm"] >= 0 and r["entropy"] > 0
        # sampler (rollout engine) and trainer compute log-probs by the same definition, in fp32
        assert r["sampler_trainer/logp_diff_mean"] <= 1e-4 and r["sampler_trainer/logp_diff_max"] <= 1e-3
    # SFT made the rewards non-zero, so some step has a real policy gradient
    assert any(r["grad_norm"] > 0 and r["advantages/abs_mean"] > 0 for r in rows)


def test_tensorboard_events_match_jsonl(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = run["run_dir"] / "tb"
    assert list(tb.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb))
    acc.Reload()
    rows = metric_rows(run["run_dir"])
    for key in ("reward/mean", "entropy", "grad_norm", "s2t/masked_frac", "time/rollout"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in rows]
        assert np.allclose([e.value for e in events], [r[key] for r in rows], rtol=1e-6, atol=1e-7)


def test_checkpoints_kept_committed_and_restorable(run):
    ckpt = run["run_dir"] / "checkpoints"
    assert committed_steps(ckpt) == [STEPS - 1, STEPS]       # keep_checkpoints=2, save_every=1
    assert not [p for p in ckpt.iterdir() if "tmp" in p.name]
    state, data, meta = restore_raw(ckpt, STEPS)
    assert meta["step"] == STEPS and len(meta["dataset_fingerprint"]) == 64
    assert data["iterator"]["next_index"] == STEPS           # one prompt batch per step (no dynamic sampling)
    prev, _, _ = restore_raw(ckpt, STEPS - 1)
    assert set(state) == {"train", "rng"}
    assert int(np.asarray(state["train"]["step"])) > int(np.asarray(prev["train"]["step"]))
    assert not np.array_equal(np.asarray(state["rng"]), np.asarray(prev["rng"]))


def test_hf_export_equals_checkpoint_and_loads_in_transformers(run):
    from flax import nnx
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from models.hf import load_hf_checkpoint

    hf_dir = run["run_dir"] / "hf"
    cfg, model = load_hf_checkpoint(hf_dir)
    state, _, _ = restore_raw(run["run_dir"] / "checkpoints", STEPS)
    ckpt_params = {k.replace("['value']", ""): v for k, v in flat_arrays(state["train"]["params"]).items()}
    assert max_abs_diff(flat_arrays(nnx.to_pure_dict(nnx.split(model)[1])), ckpt_params) == 0.0

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = np.asarray([tok.encode("Calculate 5 + 3.", add_special_tokens=False),
                      tok.encode("Calculate 7 + 1.", add_special_tokens=False)], np.int64)
    assert ids.shape[1] == len("Calculate 5 + 3.")           # the builtin character tokenizer, saved with it
    mask = np.ones_like(ids)
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, bool))
    ours = np.asarray(model.logits(hidden))
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    assert ref.shape == ours.shape == (2, ids.shape[1], cfg.vocab_size)
    assert np.abs(ref - ours).max() <= 1e-4


def test_plots_written_at_end(run):
    import matplotlib.image as mpimg

    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    assert sorted(Path(p).name for p in summary["plots"]) == sorted(PLOTS)
    for name in PLOTS:
        img = mpimg.imread(run["run_dir"] / "plots" / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0.01                    # not a blank canvas
    # held-out accuracy: the before-RL point at step 0, the after-RL point at the final step
    from stapo_jax.train.plots import run_series

    assert run_series(str(run["run_dir"]))["val/acc"] == [(0, summary["heldout_acc_before"]),
                                                          (summary["final_step"], summary["heldout_acc_after"])]


def test_plot_command(run, tmp_path):
    out = tmp_path / "plots"
    r = run_cli("plot", str(run["run_dir"]), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    listed = [Path(line) for line in r.stdout.split()]
    assert sorted(p.name for p in listed) == sorted(PLOTS)
    for p in listed:
        assert p.parent == out and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a directory without metrics is a clear error
    r = run_cli("plot", str(tmp_path / "nothing"))
    assert r.returncode != 0 and "no metrics file" in r.stderr


def test_resolved_config_saved(run):
    from stapo_jax.config.schema import load_config

    saved = load_config(run["run_dir"] / "config.yaml")
    assert saved == load_config(run["cfg"], [OVERRIDE])
    assert saved.actor.clip_ratio_high == 0.25                  # the command-line override
    assert saved.s2t.enabled is True                            # the stapo recipe default
    assert saved.trainer.run_dir == str(run["run_dir"])


def test_sft_command_writes_loadable_model(runs):
    from transformers import Qwen3ForCausalLM

    from models.hf import load_hf_checkpoint
    from models.qwen3 import Qwen3
    from stapo_jax.runtime import build
    from stapo_jax.train.batching import pack_prompt_response
    from stapo_jax.config.schema import load_config
    from stapo_jax.data.prompts import load_prompt_dataset
    from stapo_jax.train.policy import response_log_probs_and_entropy
    from stapo_jax.train.sft import gold_response_ids
    from flax import nnx

    assert runs["sft_rc"] == 0, runs["sft_log"][-4000:]
    m = re.search(r"SFT: 40 steps, loss ([\d.]+) -> ([\d.]+); saved (\S+)", runs["sft_log"])
    assert m, runs["sft_log"][-3000:]
    out = Path(m.group(3))
    assert out == runs["sft_dir"] / "sft_hf"
    cfg = load_config(runs["sft_cfg"])
    tok = build.build_tokenizer(cfg)
    examples = load_prompt_dataset(cfg, tok, "train").examples[:32]
    b = pack_prompt_response([list(e["prompt_ids"]) for e in examples],
                             [gold_response_ids(e, tok, cfg) for e in examples], pad_id=tok.pad_token_id)
    R = b["response_mask"].shape[1]
    rmask = b["response_mask"]

    def nll(model):
        lp, _ = response_log_probs_and_entropy(model, jnp.asarray(b["input_ids"]), jnp.asarray(b["attention_mask"]),
                                               R, seq_chunk=32)
        return float(-(np.asarray(lp) * rmask).sum() / rmask.sum())

    _, trained = load_hf_checkpoint(out)
    init = Qwen3(build.model_config(cfg, tok), rngs=nnx.Rngs(cfg.trainer.seed))   # what sft started from
    nll_trained, nll_init = nll(trained), nll(init)
    assert abs(nll_init - math.log(len(tok))) < 0.5              # an untrained model is near-uniform
    assert nll_trained < nll_init - 1.0                          # the saved model is the trained one

    # the same number from transformers' PyTorch Qwen3 on the same export
    hf = Qwen3ForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids, am = torch.from_numpy(b["input_ids"].astype(np.int64)), torch.from_numpy(b["attention_mask"].astype(np.int64))
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, -R - 1:-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, -R:, None])[..., 0].numpy()
    nll_torch = float(-(lp * rmask).sum() / rmask.sum())
    assert abs(nll_torch - nll_trained) < 1e-4


def _config_error(tmp_path, *overrides, yaml_extra=None):
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "run", **(yaml_extra or {}))
    return run_cli("train", "--config", str(cfg), *overrides)


@pytest.mark.parametrize("overrides, yaml_extra, expected", [
    (["actor.clip_ratio_hgh=0.3"], None,
     ["unknown config key 'actor.clip_ratio_hgh'", "did you mean 'actor.clip_ratio_high'"]),
    ([], {"trainer": {"totl_steps": 3}},
     ["unknown config key 'trainer.totl_steps'", "did you mean 'trainer.total_steps'"]),
    (["rollout.n=eight"], None, ["rollout.n: expected int, got str 'eight'"]),
])
def test_config_errors_through_the_cli(tmp_path, overrides, yaml_extra, expected):
    r = _config_error(tmp_path, *overrides, yaml_extra=yaml_extra)
    assert r.returncode != 0
    for text in expected:
        assert text in r.stderr, r.stderr[-3000:]
    assert "ConfigError" in r.stderr
    assert not (tmp_path / "run").exists()                      # nothing is written for an invalid config


def _jsonl_config(tmp_path, train_files, on_bad_row):
    return write_config(tmp_path / "j.yaml", tmp_path / "run",
                        data={"source": "jsonl", "train_files": [str(f) for f in train_files],
                              "on_bad_row": on_bad_row, "max_prompt_length": 32},
                        reward={"kind": "boxed_exact_pm1"})


def test_bad_data_row_fails_with_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join([json.dumps({"problem": "1+1?", "answer": "2"}),
                            json.dumps({"problem": "2+2?"}),
                            "{not json"]) + "\n")
    r = run_cli("train", "--config", str(_jsonl_config(tmp_path, [f], "error")))
    assert r.returncode != 0
    assert f"{f}:2: bad row (missing:answer)" in r.stderr, r.stderr[-3000:]


def test_missing_data_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    r = run_cli("train", "--config", str(_jsonl_config(tmp_path, [missing], "skip")))
    assert r.returncode != 0
    assert f"data file not found: {missing}" in r.stderr, r.stderr[-3000:]
