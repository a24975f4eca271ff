"""Orbax checkpointing: exact round trip (f32 and bf16, RNG key data, data-iterator state), keep-K,
half-written checkpoints never restored, clear errors."""
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stapo_jax.runtime.checkpoint import Checkpointer
from stapo_jax.core.errors import CheckpointError


def _state(seed):
    k = jax.random.PRNGKey(seed)
    return {"params": {"w": jax.random.normal(k, (4, 3)), "b": jnp.arange(3, dtype=jnp.bfloat16) / 3},
            "step": jnp.asarray(seed, jnp.int32), "rng": jax.random.key_data(jax.random.key(seed))}


def test_round_trip_keep_and_latest(tmp_path):
    ck = Checkpointer(str(tmp_path / "ckpt"), save_every=2, keep=2)
    for step in range(1, 7):
        ck.save(step, _state(step), data_state={"next_index": step * 10}, meta={"step": step})
    ck.wait()
    assert ck.latest_step() == 6
    assert sorted(int(d) for d in os.listdir(tmp_path / "ckpt") if d.isdigit()) == [4, 6]
    step, state, data, meta = ck.restore(_state(0))
    assert step == 6 and data == {"next_index": 60} and meta == {"step": 6}
    ref = _state(6)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    ck.close()


def test_half_written_checkpoint_is_ignored(tmp_path):
    d = tmp_path / "ckpt"
    ck = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    ck.save(1, _state(1))
    ck.wait()
    # a save killed mid-way leaves only Orbax's temporary directory behind (committed by rename on finish)
    shutil.copytree(d / "1", d / "2.orbax-checkpoint-tmp-1234")
    ck.close()
    ck2 = Checkpointer(str(d), save_every=1, keep=5)
    assert ck2.latest_step() == 1
    step, state, _, _ = ck2.restore(_state(0))
    assert step == 1 and int(state["step"]) == 1
    ck2.close()


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(str(tmp_path / "x"), save_every=0)
    ck = Checkpointer(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        ck.restore(_state(0))
    ck.save(3, _state(3), force=True)
    ck.wait()
    with pytest.raises(CheckpointError, match="cannot restore step 3"):
        ck.restore({"other": jnp.zeros((2,))})
    ck.close()


def test_damaged_step_is_one_line_naming_the_step_and_the_way_back(tmp_path):
    """A checkpoint file cut short (a disk filled up, a bad copy): restore raises a one-line CheckpointError that
    names the step, keeps at most MAX_ERROR_DETAIL characters of TensorStore's message and says how to fall back
    to the step before; that step restores intact."""
    from stapo_jax.runtime.checkpoint import MAX_ERROR_DETAIL

    d = tmp_path / "ckpt"
    ck = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    for step in (1, 2):
        ck.save(step, _state(step))
    ck.close()
    data = [p for p in (d / "2").rglob("*") if p.is_file() and "/d/" in str(p)]
    assert data, sorted(str(p) for p in (d / "2").rglob("*"))
    for p in data:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    ck = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    with pytest.raises(CheckpointError) as e:
        ck.restore(_state(0))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cannot restore step 2 from {d}"), msg
    assert f"move {d / '2'} aside" in msg and len(msg) < MAX_ERROR_DETAIL + 400, msg
    step, state, _, _ = ck.restore(_state(0), step=1)
    assert step == 1 and int(state["step"]) == 1
    ck.close()


class _Tok:
    """Stands in for the tokenizer: ``save_pretrained`` writes one file (what export_hf asks of it)."""

    def __init__(self, text: str):
        self.text = text

    def save_pretrained(self, path):
        with open(os.path.join(path, "tokenizer_marker.txt"), "w") as f:
            f.write(self.text)


def test_export_hf_replaces_the_previous_export_and_leaves_no_side_folders(tmp_path):
    """A re-export replaces ``out`` whole (the second model's weights and tokenizer file), and neither ``out.tmp``
    nor ``out.old`` (where the previous export waits during the swap) is left behind."""
    from flax import nnx

    from models.hf import load_hf_checkpoint
    from models.qwen3 import Qwen3
    from models.qwen3_config import Qwen3Config
    from stapo_jax.runtime.checkpoint import export_hf

    cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    out = str(tmp_path / "hf")
    for seed in (0, 1):
        model = Qwen3(cfg, rngs=nnx.Rngs(seed))
        assert export_hf(model, _Tok(f"run {seed}"), out) == out
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    with open(os.path.join(out, "tokenizer_marker.txt")) as f:
        assert f.read() == "run 1"
    _, loaded = load_hf_checkpoint(out)
    np.testing.assert_array_equal(np.asarray(loaded.embed_tokens.embedding[...]),
                                  np.asarray(model.embed_tokens.embedding[...]))


def test_resume_false_sets_the_earlier_runs_outputs_aside(tmp_path):
    """``trainer.resume=false`` in a run directory an earlier run wrote to (the trainer calls
    ``set_aside_earlier_run``): its checkpoints, ``metrics.jsonl``, ``tb/`` and other processes' metrics move to
    ``replaced-<time>/`` intact, so a fresh run's checkpointer starts empty, a later resume finds only the fresh
    run's steps and ``metrics.jsonl`` holds only the fresh run's rows; files of other commands stay; a run
    directory with nothing of a run, or only an empty ``checkpoints``, is left alone; only process 0 moves."""
    from stapo_jax.train.metrics import MetricsLogger, read_metrics
    from stapo_jax.train.run_files import set_aside_earlier_run

    run = tmp_path / "run"
    assert set_aside_earlier_run(str(run), main_process=True) is None  # no run directory yet
    d = run / "checkpoints"
    ck = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    assert set_aside_earlier_run(str(run), main_process=True) is None and d.is_dir()  # an empty checkpoints
    for step in (4, 5, 6):
        ck.save(step, _state(step))
    ck.close()
    logger = MetricsLogger(str(run), tensorboard=False, progress=False)
    for step in (1, 2, 3):
        logger.log(step, {"reward": 0.5})
    logger.close()
    (run / "process_1").mkdir()
    (run / "eval").mkdir()  # another command's output
    assert set_aside_earlier_run(str(run), main_process=False) is None and d.exists()  # only process 0 moves
    moved = set_aside_earlier_run(str(run), main_process=True)
    assert moved is not None and os.path.basename(moved).startswith("replaced-")
    assert sorted(os.listdir(moved)) == ["checkpoints", "metrics.jsonl", "process_1"]
    assert sorted(os.listdir(run)) == ["eval", os.path.basename(moved)]
    fresh = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    assert fresh.latest_step() is None
    fresh.save(1, _state(1))
    fresh.wait()
    assert fresh.latest_step() == 1
    fresh.close()
    logger = MetricsLogger(str(run), tensorboard=False, progress=False)
    logger.log(1, {"reward": 0.25})
    logger.close()
    assert [(r["step"], r["reward"]) for r in read_metrics(str(run))] == [(1, 0.25)]
    assert [r["step"] for r in read_metrics(moved)] == [1, 2, 3]
    again = set_aside_earlier_run(str(run), main_process=True)  # a new folder (with -1 within the same second)
    assert again is not None and again != moved and sorted(os.listdir(again)) == ["checkpoints", "metrics.jsonl"]
    user = tmp_path / "user"  # a run_dir that holds no run (e.g. trainer.run_dir=.): its files stay put
    (user / "plots").mkdir(parents=True)
    (user / "config.yaml").write_text("mine: 1\n")
    assert set_aside_earlier_run(str(user), main_process=True) is None
    assert sorted(os.listdir(user)) == ["config.yaml", "plots"]
    old = Checkpointer(os.path.join(moved, "checkpoints"), save_every=1, keep=5, async_save=False)
    assert old.latest_step() == 6
    step, state, _, _ = old.restore(_state(0))
    assert step == 6
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.asarray(_state(6)["params"]["w"]))
    old.close()


def test_cli_prints_a_checkpoint_error_as_one_line(monkeypatch, capsys):
    """``stapo-jax <command>`` turns a CheckpointError (e.g. the damaged step above, raised by ``train``'s resume)
    into one ``error:`` line and exit code 2; other runtime errors still propagate."""
    import types

    from stapo_jax.tools import cli

    def main(argv):
        raise {"ckpt": CheckpointError("cannot restore step 2 from /x (move /x/2 aside ...)"),
               "other": RuntimeError("boom")}[argv[0]]

    monkeypatch.setitem(sys.modules, "fake_cmd", types.SimpleNamespace(main=main))
    monkeypatch.setitem(cli.COMMANDS, "fake", ("fake_cmd", "a test command"))
    assert cli.main(["fake", "ckpt"]) == 2
    assert capsys.readouterr().err == "stapo-jax fake: error: CheckpointError: cannot restore step 2 from /x " \
                                      "(move /x/2 aside ...)\n"
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["fake", "other"])


def test_incomplete_latest_step_folder_is_one_error_naming_it(tmp_path):
    """A step folder without the items every save writes (a non-atomic rename on a gcsfuse mount cut short, an
    interrupted copy of the run directory) is not a checkpoint: latest_step, restore and read_meta raise one
    CheckpointError naming the folder and the way back, instead of reporting the step as reached (a resumed run
    then ended at once, "already reached step 3", with nothing trained or saved). Moved aside, step 2 restores."""
    d = tmp_path / "ckpt"
    ck = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    for step in (1, 2):
        ck.save(step, _state(step), meta={"step": step})
    ck.close()
    os.makedirs(d / "3" / "state")  # the state item started, data and meta never arrived
    ck = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    for call in (ck.latest_step, lambda: ck.restore(_state(0)), ck.read_meta):
        with pytest.raises(CheckpointError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and f"step 3 in {d} is incomplete" in msg, msg
        assert f"move {d / '3'} aside" in msg, msg
    ck.close()
    shutil.move(str(d / "3"), str(tmp_path / "3.aside"))
    ck = Checkpointer(str(d), save_every=1, keep=5, async_save=False)
    assert ck.latest_step() == 2
    step, state, _, meta = ck.restore(_state(0))
    assert step == 2 and int(state["step"]) == 2 and meta == {"step": 2}
    ck.close()
