"""Orbax checkpointing: exact round trip (f32 and bf16, RNG key data, data-iterator state), keep-K,
half-written checkpoints never restored, clear errors."""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stapo_jax.runtime.checkpoint import CheckpointError, Checkpointer


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
