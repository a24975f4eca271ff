"""model.use_remove_padding (verl's switch, stapo_jax/train/packing.py): the trainer with packed micro-batches
gives the padded trainer's per-step metrics (fp32, 1e-5) on a tiny 2-step STAPO run, in one process with 8
data-parallel shards and as 2 JAX processes (local, 127.0.0.1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")

STEPS = 2
OVERRIDES = ["sft.steps=0", f"trainer.total_steps={STEPS}", "trainer.train_batch_size=4", "rollout.n=4",
             "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size=2", "trainer.eval_every=0",
             "trainer.save_every=0", "trainer.export_hf=false", "data.gym.size=64", "data.gym.val_size=0",
             "reward.num_workers=1", "rollout.max_concurrent_decodes=16", "model.num_hidden_layers=1",
             "reward.overlong_buffer_len=6"]   # DAPO length shaping: non-zero advantages from a random model


def _launch(n: int, devices: int, args: list[str]) -> subprocess.CompletedProcess:
    """``stapo-jax launch --local n`` (n JAX processes of ``devices`` CPU devices each on 127.0.0.1)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", STAPO_DISTRIBUTED="auto")
    cmd = [sys.executable, "-m", "stapo_jax", "launch", "--local", str(n), "--devices-per-process", str(devices),
           "--timeout", "900", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1000)


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and not k.endswith("tokens_per_s")} for r in rows]


def _assert_same(packed: list[dict], padded: list[dict]) -> None:
    assert len(packed) == len(padded) == STEPS
    for a, b in zip(packed, padded):
        assert a.keys() == b.keys()
        assert b["loss_denominator"] > 0 and b["grad_norm"] > 0 and "s2t/tau_h" in b
        for k, v in b.items():
            if isinstance(v, (int, float)):
                assert abs(a[k] - v) <= 1e-5 * max(1.0, abs(v)), (k, a[k], v)


def test_packed_trainer_equals_padded_trainer(tmp_path):
    """8 CPU devices (conftest): 2 mini-batches of 16 rows, 2 rows per data-parallel shard."""
    from stapo_jax.config.schema import load_config
    from stapo_jax.train.trainer import train

    out = {}
    for flag in (True, False):
        run_dir = tmp_path / str(flag)
        cfg = load_config(CONFIG, [*OVERRIDES, "trainer.train_batch_size=8", "actor.ppo_mini_batch_size=4", f"model.use_remove_padding={str(flag).lower()}",
                                   f"trainer.run_dir={run_dir}"])
        train(cfg)
        out[flag] = _metrics(run_dir)
    _assert_same(out[True], out[False])


def test_packed_trainer_equals_padded_trainer_in_two_processes(tmp_path):
    """2 processes x 1 device: each process packs its own rows (shard-local layout); same metrics as padded."""
    out = {}
    for flag in ("true", "false"):
        run_dir = tmp_path / flag
        r = _launch(2, 1, ["--config", CONFIG, *OVERRIDES, f"model.use_remove_padding={flag}",
                                 f"trainer.run_dir={run_dir}"])
        assert r.returncode == 0, f"{flag}:\n{r.stdout[-4000:]}\n{r.stderr[-3000:]}"
        out[flag] = _metrics(run_dir)
    _assert_same(out["true"], out["false"])
