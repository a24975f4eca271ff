"""Regressions from the bad-input review: padding that holds NaN, non-finite settings, broken files."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stapo_jax.algo.objectives import LOSS_AGG_MODES, PolicyLossConfig, PolicyLossInputs, compute_policy_loss


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_nan_in_padding_never_reaches_loss_or_gradient(mode):
    mask = jnp.ones((2, 5)).at[:, 3:].set(0)
    old = jnp.full((2, 5), -1.1)
    adv = jnp.array([1.0, -0.5])
    clean_lp = jnp.full((2, 5), -1.0)
    dirty_lp = clean_lp.at[0, 4].set(jnp.nan).at[1, 3].set(jnp.inf)
    dirty_old = old.at[1, 4].set(jnp.nan)
    cfg = PolicyLossConfig(loss_agg_mode=mode)

    def loss(lp, o):
        return compute_policy_loss(PolicyLossInputs(o, lp, adv, mask), cfg)[0]

    ref_v, ref_g = jax.value_and_grad(loss)(clean_lp, old)
    v, g = jax.value_and_grad(loss)(dirty_lp, dirty_old)
    assert np.isfinite(float(ref_v)) and float(ref_v) != 0.0
    np.testing.assert_allclose(float(v), float(ref_v), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref_g), rtol=1e-6)


def test_check_rejects_corrupt_empty_and_non_finite_dumps(tmp_path, capsys):
    from safetensors.numpy import save_file

    from stapo_jax.tools.check import main as check_main

    (tmp_path / "text.safetensors").write_text("not a safetensors file")
    assert check_main([str(tmp_path / "text.safetensors")]) == 2
    assert "not a readable dump" in capsys.readouterr().err
    base = {"log_probs": np.full((2, 3), -1.0, np.float32), "old_log_probs": np.full((2, 3), -1.0, np.float32),
            "advantages": np.array([1.0, -1.0], np.float32), "response_mask": np.ones((2, 3), np.float32),
            "entropy": np.full((2, 3), 0.5, np.float32)}
    empty = {k: v[:0] for k, v in base.items()}
    save_file(empty, str(tmp_path / "empty.safetensors"))
    assert check_main([str(tmp_path / "empty.safetensors")]) == 2
    assert "non-empty [B, T]" in capsys.readouterr().err
    bad = dict(base, log_probs=base["log_probs"].copy())
    bad["log_probs"][1, 2] = np.nan
    save_file(bad, str(tmp_path / "nan.safetensors"))
    assert check_main([str(tmp_path / "nan.safetensors")]) == 2
    assert "'log_probs' has non-finite values at valid positions, first at (1, 2)" in capsys.readouterr().err


@pytest.mark.parametrize("override,message", [
    ("actor.optim.lr=inf", "actor.optim.lr: 'inf' is not a finite number"),
    ("actor.clip_ratio_high=nan", "actor.clip_ratio_high: 'nan' is not a finite number"),
    ("trainer.run_dir=", "trainer.run_dir is empty"),
])
def test_config_rejects_non_finite_numbers_and_empty_run_dir(override, message):
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config("configs/tiny_cpu.yaml", [override])


def test_pack_rejects_zero_lengths():
    from stapo_jax.train.batching import pack_prompt_response

    for kw in (dict(prompt_length=0), dict(response_length=0), dict(pad_multiple=0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            pack_prompt_response([[1, 2]], [[3]], pad_id=0, **kw)


def test_demo_checks_the_context_limit(capsys):
    from stapo_jax.tools.demo import main as demo_main

    assert demo_main(["--max-new-tokens", "100000"]) == 2
    assert "exceeds the model's max_position_embeddings (40960)" in capsys.readouterr().err


@pytest.mark.parametrize("prompts,responses,kw,message", [
    ([[1, 2], [3, -1]], [[4], [5]], {}, r"prompt 1 has token id -1 at position 1, outside \[0, "),
    ([[1, 2], [3]], [[4], [5, 6, -7]], {}, r"response 1 has token id -7 at position 2"),
    ([[1, 2], [3]], [[4, 10], [5]], dict(vocab_size=10), r"response 0 has token id 10 at position 1, "
                                                         r"outside \[0, vocab_size=10\)"),
    ([[1, 12]], [[4]], dict(vocab_size=10), r"prompt 0 has token id 12 at position 1"),
    ([[1, 2.5]], [[4]], {}, r"prompt 0 must be a flat list of integer token ids"),
])
def test_pack_rejects_out_of_range_token_ids(prompts, responses, kw, message):
    from stapo_jax.train.batching import pack_prompt_response

    with pytest.raises(ValueError, match=message):
        pack_prompt_response(prompts, responses, pad_id=0, **kw)
    # the same batch with the bad id replaced packs, ids in place
    good = pack_prompt_response([[abs(int(t)) % 10 for t in p] for p in prompts],
                                [[abs(int(t)) % 10 for t in r] for r in responses], pad_id=0, vocab_size=10)
    assert good["input_ids"].max() < 10 and good["input_ids"].min() >= 0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "nonzero_variance"])
@pytest.mark.parametrize("ids,num_groups,message", [
    ([0, 0, 1, -1], 2, r"group_ids\[3\] = -1 is outside \[0, num_groups=2\)"),
    ([0, 2, 1, 1], 2, r"group_ids\[1\] = 2 is outside \[0, num_groups=2\)"),
])
def test_advantages_reject_concrete_group_ids_out_of_range(name, ids, num_groups, message):
    from stapo_jax.algo.advantages import compute_advantages, nonzero_variance_groups

    def run(r, g):
        if name == "nonzero_variance":
            return nonzero_variance_groups(r, g, num_groups=num_groups)
        return compute_advantages(name, r, g, num_groups=num_groups)

    rewards = jnp.array([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match=message):
        run(rewards, jnp.asarray(ids, jnp.int32))
    with pytest.raises(ValueError, match=message):  # host (numpy) ids too
        run(rewards, np.asarray(ids))
    # traced ids are not checked (jit-compatible): in-range ids give the eager result under jit
    good = jnp.array([0, 0, 1, 1], jnp.int32)
    fn = (lambda r, g: nonzero_variance_groups(r, g, num_groups=2)) if name == "nonzero_variance" else \
        (lambda r, g: compute_advantages(name, r, g, num_groups=2))
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(rewards, good)), np.asarray(fn(rewards, good)))


def test_jsonl_with_a_bad_utf8_byte_names_file_and_line(tmp_path):
    from stapo_jax.config.schema import load_config
    from stapo_jax.data.prompts import DataError, load_prompt_dataset
    from stapo_jax.data.tokenizer import build_builtin_tokenizer

    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"problem": "ok 1", "answer": "1"}\n'  # a UTF-8 BOM on line 1 is fine
                  b'{"problem": "caf\xe9", "answer": "2"}\n'         # latin-1 byte: not UTF-8
                  b'{"problem": "ok 3", "answer": "3"}\n')
    tok = build_builtin_tokenizer()
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: bad row \(invalid_utf8\)"):
        load_prompt_dataset(load_config(None, [f"data.train_files=[{p}]", "data.on_bad_row=error"]), tok)
    ds = load_prompt_dataset(load_config(None, [f"data.train_files=[{p}]"]), tok)
    assert [ex["problem"] for ex in ds.examples] == ["ok 1", "ok 3"]
    assert [ex["index"] for ex in ds.examples] == [0, 2]
    assert ds.report.bad_reasons == {"invalid_utf8": 1}


def _metrics_file(tmp_path, lines: list[bytes]):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes(b"".join(lines))
    return run


_ROW = lambda s: json.dumps({"step": s, "reward/mean": 0.1 * s, "entropy": 1.0 - 0.1 * s}).encode()  # noqa: E731


@pytest.mark.parametrize("bad,message", [
    (b"[1, 2]", r"metrics\.jsonl:2: expected one JSON object per line, got a JSON list"),
    (b'{"step": 2, "reward/m', r"metrics\.jsonl:2: not a JSON line"),  # cut-off row in the middle
    (b'{"reward/mean": 0.5}', r"metrics\.jsonl:2: the row has no integer 'step'"),
])
def test_plot_names_file_and_line_of_a_bad_middle_line(tmp_path, capsys, bad, message):
    from stapo_jax.tools.cli import main as cli_main
    from stapo_jax.train.metrics import read_metrics

    run = _metrics_file(tmp_path, [_ROW(1) + b"\n", bad + b"\n", _ROW(3) + b"\n"])
    with pytest.raises(ValueError, match=message):
        read_metrics(str(run))
    assert cli_main(["plot", str(run)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err


def test_metrics_truncated_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    from stapo_jax.train.metrics import MetricsLogger, read_metrics

    run = _metrics_file(tmp_path, [_ROW(1) + b"\n", _ROW(2) + b"\n", _ROW(3)[:15]])  # killed mid-write
    with caplog.at_level("WARNING", logger="stapo_jax.train.metrics"):
        rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["reward/mean"] == pytest.approx(0.2)
    assert "metrics.jsonl:3: skipping a half-written last line" in caplog.text
    # a bad last line that was fully written (newline-terminated) is corrupt, not truncated
    bad_end = _metrics_file(tmp_path / "b", [_ROW(1) + b"\n", b"[3]\n"])
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: expected one JSON object"):
        read_metrics(str(bad_end))
    # a resumed run appends after the cut-off row without gluing onto it
    log = MetricsLogger(str(run), progress=False, tensorboard=False)
    log.log(3, {"reward/mean": 0.3})
    log.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="stapo_jax.train.metrics"):
        assert [r["step"] for r in read_metrics(str(run))] == [1, 2, 3]
    assert caplog.text == ""
    assert (run / "metrics.jsonl").read_bytes().endswith(b'"reward/mean": 0.3}\n')


def test_plot_accepts_the_metrics_file_path_and_rejects_a_file_as_out_dir(tmp_path, capsys):
    from stapo_jax.tools.cli import main as cli_main

    run = _metrics_file(tmp_path, [_ROW(1) + b"\n", _ROW(2) + b"\n"])
    assert cli_main(["plot", str(run / "metrics.jsonl")]) == 0
    written = capsys.readouterr().out.split()
    assert sorted(os.path.basename(p) for p in written) == ["curves.png", "entropy.png", "reward_mean.png"]
    assert all(os.path.dirname(p) == str(run / "plots") for p in written)
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in written)
    (tmp_path / "taken").write_text("x")
    assert cli_main(["plot", str(run), "--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err
    assert f"plot output directory {tmp_path / 'taken'} is an existing file" in err and "Traceback" not in err


def test_config_reports_every_unknown_key_at_once(tmp_path):
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError

    p = tmp_path / "typos.yaml"
    p.write_text("rolout:\n  n: 4\nactor:\n  clip_ratio_hi: 0.3\n  optim:\n    weight_decy: 0.0\n"
                 "s2t:\n  tau_h: 0.5\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["trainer.total_step=3"])
    lines = str(e.value).splitlines()
    assert lines[0] == "5 unknown config keys:"
    assert lines[1:] == [
        "  unknown config key 'rolout'; did you mean 'rollout'?",
        "  unknown config key 'actor.clip_ratio_hi'; did you mean 'actor.clip_ratio_high'?",
        "  unknown config key 'actor.optim.weight_decy'; did you mean 'actor.optim.weight_decay'?",
        "  unknown config key 's2t.tau_h'; did you mean 's2t.tau_p'?",
        "  unknown config key 'trainer.total_step'; did you mean 'trainer.total_steps'?",
    ]


@pytest.mark.parametrize("overrides,message", [
    # 1 sequence per mini-batch cannot split over the 8 simulated data-parallel devices (known only at run time)
    (["actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=1", "rollout.n=1", "trainer.train_batch_size=1"],
     r"actor.ppo_mini_batch_size=1 x rollout.n=1 = 1 sequences do not split into 8 data-parallel shards: nearest "
     r"actor.ppo_mini_batch_size that does: 8 \(trainer.train_batch_size a multiple of it\)"),
    (["data.source=jsonl", "data.train_files=[]", "reward.kind=boxed_exact_pm1"],
     r"data.train_files is empty \(data.source=jsonl\)"),
])
def test_train_that_fails_validation_writes_nothing(tmp_path, overrides, message):
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.train.trainer import train

    assert jax.device_count() == 8  # tests/conftest.py
    run_dir = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.yaml", [f"trainer.run_dir={run_dir}", "sft.steps=0", "data.gym.size=16",
                                                "data.gym.val_size=0", "trainer.total_steps=1", *overrides])
    with pytest.raises(ConfigError, match=message):
        train(cfg)
    assert not run_dir.exists()  # no config.yaml, no checkpoints directory, nothing


@pytest.mark.parametrize("overrides,error,message", [
    # an attention kernel this backend cannot run: refused before the run dir exists (was: after config.yaml)
    (["model.attention=cudnn"], "AttentionError", r"model.attention='cudnn' needs an NVIDIA GPU"),
    # mesh sizes that do not fit the 8 simulated devices: the error names the mesh.* keys
    (["mesh.data=3"], "ConfigError", r"mesh.data=3 x mesh.fsdp=1 x mesh.tensor=1 does not fit the 8 devices"),
])
def test_train_with_an_impossible_device_setting_writes_nothing(tmp_path, overrides, error, message):
    from models.attention import AttentionError
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.train.trainer import train

    run_dir = tmp_path / "run"
    cfg = load_config("configs/tiny_cpu.yaml", [f"trainer.run_dir={run_dir}", "sft.steps=0", "data.gym.size=16",
                                                "data.gym.val_size=0", "trainer.total_steps=1", *overrides])
    with pytest.raises({"AttentionError": AttentionError, "ConfigError": ConfigError}[error], match=message):
        train(cfg)
    assert not run_dir.exists()


@pytest.mark.parametrize("kwargs,match", [
    (dict(mini_rows=8, num_micro_batches=0, num_shards=2), r"num_micro_batches=0"),  # was ZeroDivisionError
    (dict(mini_rows=8, num_micro_batches=8, num_shards=2), r"num_shards=2 x num_micro_batches=8"),  # returned 8
    (dict(mini_rows=8, num_micro_batches=3, num_shards=1), r"num_micro_batches=3"),  # returned 3
    (dict(mini_rows=8, num_micro_batches=2, num_shards=0), r"num_shards=0"),  # was ZeroDivisionError
])
def test_token_budget_rejects_sizes_that_do_not_split(kwargs, match):
    from stapo_jax.train.micro_batches import token_budget_micro_batches

    mask = np.arange(12)[None] < np.arange(1, 17)[:, None] % 12 + 1  # [16, 12], lengths 1..12
    with pytest.raises(ValueError, match=match):
        token_budget_micro_batches(mask, **kwargs)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, P \+ R\], got shape \(12,\)"):
        token_budget_micro_batches(mask[0], mini_rows=8, num_micro_batches=2)
    assert token_budget_micro_batches(mask, mini_rows=8, num_micro_batches=4, num_shards=2)[0] in (1, 2, 4)


def test_a_micro_batch_size_that_does_not_divide_the_shard_is_named_not_grown():
    """64 rows per shard with actor.ppo_micro_batch_size=48 trained with micro-batches of 64 (K = 64 // 48 = 1),
    above the size the user set for memory; now a ConfigError naming the key, as ``Config.grad_accum_steps``."""
    from types import SimpleNamespace

    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.train.batch_shapes import check_batch_shapes

    def shards(n):  # a mesh of n data-parallel shards, as the trainer's check reads it
        return SimpleNamespace(shape={"data": 1, "fsdp": n, "tensor": 1}, axis_names=("data", "fsdp", "tensor"))

    cfg = load_config("configs/tiny_cpu.yaml", ["actor.ppo_micro_batch_size=48"])
    with pytest.raises(ConfigError, match=r"actor\.ppo_micro_batch_size=48 does not divide the 64 sequences"):
        check_batch_shapes(cfg, shards(2), sft=False)  # 128 sequences / 2 shards = 64, not a multiple of 48
    with pytest.raises(ConfigError, match=r"do not split into 2 data-parallel shards"):
        cfg.grad_accum_steps(2)  # the plan's count agrees
    assert check_batch_shapes(load_config("configs/tiny_cpu.yaml", ["actor.ppo_micro_batch_size=16"]), shards(2),
                              sft=False) == 4
    assert check_batch_shapes(cfg, shards(4), sft=False) == 1  # 32 rows per shard < 48: the shard's rows


def test_resume_may_switch_the_attention_kernel_but_not_the_model_size(tmp_path):
    """model.attention / model.remat do not change the parameter tree: resuming an xla run with blockwise was
    refused as "checkpoints of a different model"; a size change still is, naming the key."""
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError
    from stapo_jax.train.run_files import check_same_model

    load_config("configs/tiny_cpu.yaml", ["model.attention=xla", "model.remat=none"]).save(tmp_path)
    check_same_model(load_config("configs/tiny_cpu.yaml", ["model.attention=blockwise", "model.remat=full"]),
                     str(tmp_path))
    with pytest.raises(ConfigError, match=r"model\.hidden_size 128 -> 64"):
        check_same_model(load_config("configs/tiny_cpu.yaml", ["model.hidden_size=64"]), str(tmp_path))
