"""The quick part of the multi-process soak (tests/soak.py, ``make soak`` for the whole of it): one configuration at
the tiny config's ``rollout.max_concurrent_decodes`` (128, the value that deadlocked XLA:CPU before issue 34) with
56 rollout rows (7 prompts x 8: 63 sampler programs between two host waits in the 1 x 4 run, above XLA:CPU's 32
in-flight computations per device), run as 2 processes x 2 devices and as 1 x 4: both finish within the bound and
give the same prompts, sampled tokens, rewards and HF export (1e-5). The draw of the soak space is checked too."""
from __future__ import annotations

from soak import compare_runs, draw_configs, soak_one

QUICK = ["algorithm.recipe=stapo", "sft.steps=20", "rollout.n=8", "rollout.max_new_tokens=8",
         "rollout.steps_per_sync=8", "trainer.train_batch_size=7", "actor.ppo_mini_batch_size=7",
         "actor.ppo_micro_batch_size=7", "trainer.total_steps=1"]


def test_soak_space_is_seeded_and_varied():
    a, b = draw_configs(0, 8), draw_configs(0, 8)
    assert a == b and a != draw_configs(1, 8)
    drawn = [dict(x.split("=", 1) for x in c) for c in draw_configs(0, 32)]
    for key in ("rollout.n", "rollout.max_new_tokens", "rollout.steps_per_sync", "rollout.kv_cache_buckets",
                "algorithm.recipe", "trainer.train_batch_size"):
        assert len({d[key] for d in drawn}) >= 2, key
    assert any("sampling.dynamic" in d for d in drawn) and any(d["algorithm.recipe"] == "dapo" for d in drawn)
    assert all(int(d["trainer.train_batch_size"]) % 4 for d in drawn)  # prompts never split evenly over 4
    assert all(0 <= int(d["sft.steps"]) <= 40 for d in drawn)


def test_quick_soak_two_by_two_equals_one_by_four(tmp_path):
    failures = soak_one(QUICK, tmp_path, layouts=((2, 2),), timeout_s=600)
    assert failures == [], "\n".join(failures)
    assert compare_runs(tmp_path / "1x4", tmp_path / "2x2") == []
    assert compare_runs(tmp_path / "1x4", tmp_path / "missing") != []  # the comparison can fail
