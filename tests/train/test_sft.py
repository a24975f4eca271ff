"""SFT warm-up: the cross-entropy step learns a tiny mapping; masked batches are inert."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decode import greedy_generate
from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from stapo_jax.runtime.compile_stats import CompileStats
from stapo_jax.train.optim import make_optimizer
from stapo_jax.train.sft import run_sft, sft_step

CFG = Qwen3Config(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, eos_token_id=1, pad_token_id=0)


def _examples():
    # prompt [2, a, b] -> response [(a + b) % 10 + 10, EOS]
    rng = np.random.RandomState(0)
    while True:
        a, b = rng.randint(0, 5, 2)
        yield [2, 3 + a, 3 + b], [10 + (a + b) % 10, 1]


def test_sft_learns_and_updates_model_in_place():
    model = Qwen3(CFG, rngs=nnx.Rngs(0))
    hist = run_sft(model, _examples(), steps=100, batch_size=32, lr=1e-2, warmup_steps=5, pad_id=0)
    assert hist[0]["sft/loss"] > 2.0 and hist[-1]["sft/loss"] < 0.3
    assert hist[0]["sft/tokens"] == 64.0
    prompts = np.array([[2, 3 + a, 3 + b] for a in range(5) for b in range(5)])
    toks, lens = greedy_generate(model, prompts, np.ones_like(prompts), 2, eos_token_ids=[1])
    want = np.array([10 + (a + b) % 10 for a in range(5) for b in range(5)])
    assert (toks[:, 0] == want).mean() >= 0.9 and (toks[:, 1] == 1).mean() >= 0.9


def test_all_masked_batch_is_a_zero_update():
    model = Qwen3(CFG, rngs=nnx.Rngs(1))
    gd, params = nnx.split(model)
    before = jax.tree.map(np.asarray, params)
    opt = make_optimizer(1e-2, 0, 0.0, None)
    ids = jnp.ones((2, 6), jnp.int32)
    p2, _, m = sft_step(gd, opt, 3, 512, params, opt.init(params), ids, jnp.ones((2, 6), bool),
                        jnp.zeros((2, 3), bool))
    assert float(m["sft/loss"]) == 0.0 and float(m["sft/grad_norm"]) == 0.0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_sft_progress_bar_shows_step_loss_and_eta(capsys):
    """``progress=True``: a tqdm bar ``sft`` on stderr with the step count, the last loss and the rate/ETA
    fields; without it nothing is printed."""
    model = Qwen3(CFG, rngs=nnx.Rngs(2))
    hist = run_sft(model, _examples(), steps=3, batch_size=4, lr=1e-2, warmup_steps=0, pad_id=0, progress=True)
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("sft: 100%") and "3/3" in final and "<00:00" in final          # count, elapsed<ETA
    assert re.search(r"\d(s/step|step/s|it/s)", final), final                                # rate
    assert f"loss={hist[-1]['sft/loss']:.4f}" in final
    run_sft(model, _examples(), steps=2, batch_size=4, lr=1e-2, warmup_steps=0, pad_id=0)
    assert capsys.readouterr().err == ""


def test_should_stop_ends_the_warm_up_at_the_next_check():
    """The trainer passes its SIGTERM agreement as ``should_stop``: asked every ``check_every`` steps (never after
    the last step), True ends the warm-up there and the model keeps the steps taken."""
    model = Qwen3(CFG, rngs=nnx.Rngs(3))
    before = jax.tree.map(np.asarray, nnx.split(model)[1])
    asked = []

    def should_stop():
        asked.append(len(asked))
        return len(asked) == 2

    hist = run_sft(model, _examples(), steps=50, batch_size=4, lr=1e-2, warmup_steps=0, pad_id=0,
                   should_stop=should_stop, check_every=3)
    assert len(hist) == 6 and asked == [0, 1]
    after = jax.tree.map(np.asarray, nnx.split(model)[1])
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    asked.clear()
    assert len(run_sft(model, _examples(), steps=6, batch_size=4, lr=1e-2, warmup_steps=0, pad_id=0,
                       should_stop=lambda: asked.append(1) or False, check_every=3)) == 6
    assert asked == [1]  # asked after step 3, not after the last step


def test_sft_batch_rows_over_the_data_axes():
    """With the model on a 4-device data mesh, each device gets 2 of the 8 rows (the step all-reduces the
    gradient): same losses and parameters as the whole batch on one device within float tolerance, the step
    compiled once for batches of one shape; a batch size that does not split over the shards names
    ``sft.batch_size``."""
    import pytest

    from models.sharding import make_mesh, shard_model
    from stapo_jax.train.sft import model_mesh

    mesh = make_mesh(data=4, devices=jax.devices()[:4])
    one, dp = Qwen3(CFG, rngs=nnx.Rngs(4)), shard_model(Qwen3(CFG, rngs=nnx.Rngs(4)), mesh)
    assert model_mesh(one) is None and model_mesh(dp) is mesh
    h1 = run_sft(one, _examples(), steps=5, batch_size=8, lr=1e-2, warmup_steps=0, pad_id=0)
    with CompileStats() as stats:  # the batches have one shape: the step compiles once, not again at step 2
        h4 = run_sft(dp, _examples(), steps=5, batch_size=8, lr=1e-2, warmup_steps=0, pad_id=0)
    (row,) = [r for r in stats.table() if r["program"] == "sft_step"]
    assert row["n_compiles"] + row["cache_hits"] == 1, row
    for key in ("sft/loss", "sft/grad_norm"):
        np.testing.assert_allclose([m[key] for m in h4], [m[key] for m in h1], rtol=1e-5, err_msg=key)
    assert h4[0]["sft/tokens"] == 16.0
    p1, p4 = nnx.split(one)[1], nnx.split(dp)[1]
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        assert b.sharding.mesh is mesh
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4)  # another summation order, x5 Adam steps
    with pytest.raises(ValueError, match=r"sft\.batch_size=6 does not split into 4 data-parallel shards"):
        run_sft(dp, _examples(), steps=1, batch_size=6, lr=1e-2, warmup_steps=0, pad_id=0)
