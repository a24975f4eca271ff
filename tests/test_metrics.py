"""metrics.jsonl / TensorBoard / plots."""
import json
import os

import numpy as np
import pytest

from stapo_jax.metrics import MetricsLogger, read_metrics
from stapo_jax.plots import main as plot_main


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
