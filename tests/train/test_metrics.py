"""metrics.jsonl / TensorBoard / plots."""
import json
import os

import numpy as np
import pytest

from stapo_jax.train.metrics import MetricsLogger, read_metrics
from stapo_jax.train.plots import main as plot_main


def test_logger_writes_jsonl_tb_and_plots(tmp_path):
    log = MetricsLogger(str(tmp_path), total_steps=3, progress=False)
    for s in range(3):
        log.log(s, {"reward/mean": np.float32(0.1 * s), "entropy": 1.0 - 0.1 * s, "s2t/masked_frac": 1e-4,
                    "response_length/mean": 5 + s, "bad": float("nan")})
    log.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["reward/mean"] == pytest.approx(0.2) and rows[0]["bad"] is None
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
    assert plot_main([str(tmp_path)]) == 0
    pngs = sorted(os.listdir(tmp_path / "plots"))
    assert pngs == ["curves.png", "entropy.png", "response_length_mean.png", "reward_mean.png", "s2t_masked_frac.png"]
    assert all((tmp_path / "plots" / p).stat().st_size > 1000 for p in pngs)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_metrics(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "x": 1}) + "\nnot json\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(str(tmp_path))
    log = MetricsLogger(str(tmp_path / "r"), progress=False, tensorboard=False)
    with pytest.raises(ValueError, match="scalar"):
        log.log(0, {"v": np.zeros(3)})
    log.close()


def test_progress_bar_advances_between_logged_rows_and_closes_before_summary_lines(tmp_path, capsys):
    logger = MetricsLogger(str(tmp_path), total_steps=4, tensorboard=False, progress=True)
    logger.log(1, {"loss": 1.0})
    logger.advance(2)
    logger.advance(3)
    assert logger._bar.n == 3  # steps without a metrics row still move the bar
    logger.log(4, {"loss": 0.5})
    logger.close_progress()
    logger.write("held-out accuracy after RL: 0.5")
    out = capsys.readouterr()
    assert out.out.strip() == "held-out accuracy after RL: 0.5"  # printed plainly, not through a redrawn bar
    assert out.err.count("4/4") >= 1
    logger.close()
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line]
    assert len(rows) == 2


def _wandb_records(path, block=32768):
    """Records of a W&B transaction log (``run-<id>.wandb``): a 7-byte header (``:W&B``, magic, version), then
    LevelDB-log framing (crc32 4 bytes, length 2, type 1: full / first / middle / last) of ``Record`` protos."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or kind == 0:                      # block trailer / zero padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_trainer_logger_wandb_offline(tmp_path, monkeypatch):
    """``trainer.logger=[console, wandb]`` in offline mode (no network): every row goes to W&B under
    ``<run_dir>/wandb`` with the run named after the run directory, metrics.jsonl is still written, and no
    TensorBoard files appear (not chosen)."""
    import glob

    from stapo_jax.config.schema import load_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "my_run"
    cfg = load_config(None, ["trainer.logger=[console,wandb]", f"trainer.run_dir={run_dir}", "trainer.total_steps=3"])
    log = MetricsLogger.from_config(str(run_dir), cfg)
    for s in (1, 2, 3):
        log.log(s, {"reward/mean": 0.25 * s, "entropy": np.float32(2.0), "missing": float("nan")})
    log.close()
    import wandb

    wandb.teardown()        # stop the W&B service: it flushes the transaction log (process exit does the same)
    assert [r["reward/mean"] for r in read_metrics(str(run_dir))] == [0.25, 0.5, 0.75]
    assert not (run_dir / "tb").exists()
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, runs = [], []
    for rec in _wandb_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "run":
            runs.append(rec.run)
    assert runs[0].display_name == "my_run" and runs[0].project == "stapo_jax"
    assert [(h["_step"], h["reward/mean"], h["entropy"]) for h in history] == [(1, 0.25, 2.0), (2, 0.5, 2.0),
                                                                               (3, 0.75, 2.0)]
    assert all("missing" not in h for h in history)             # a non-finite value is not sent


def test_trainer_logger_names_an_unknown_logger():
    from stapo_jax.config.schema import load_config
    from stapo_jax.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.logger: unknown logger\(s\) \['mlflow'\]"):
        load_config(None, ["trainer.logger=[console,mlflow]"])
