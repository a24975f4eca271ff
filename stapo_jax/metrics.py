"""Per-step metrics of a run: one JSON object per line in ``metrics.jsonl``, TensorBoard event files
(tensorboardX) and a tqdm progress bar on the console."""
from __future__ import annotations

import json
import math
import os
from typing import Mapping, Optional

import numpy as np

# shown in the progress bar, in this order, when present
_BAR_KEYS = ("reward/mean", "acc/mean", "entropy", "s2t/masked_frac", "response_length/mean", "loss")


def to_python(v):
    """A JSON-friendly float/int from a Python, NumPy or JAX scalar (non-finite floats become null)."""
    v = np.asarray(v)
    if v.size != 1:
        raise ValueError(f"metric value must be a scalar, got shape {v.shape}")
    v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Write scalar metrics per step.

    Args:
      run_dir: directory for ``metrics.jsonl`` and ``tb/`` (created).
      total_steps: length of the progress bar (steps).
      tensorboard: write TensorBoard events under ``run_dir/tb``.
      progress: show a tqdm progress bar on stderr.
    """

    def __init__(self, run_dir: str, total_steps: Optional[int] = None, *, tensorboard: bool = True,
                 progress: bool = True, desc: str = "train"):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a", buffering=1)
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
        self._bar = None  # created at the first step, so warm-up phases do not count towards its rate
        self._bar_args = dict(total=total_steps, desc=desc, dynamic_ncols=True) if progress else None

    def _ensure_bar(self, initial: int = 0):
        if self._bar is None and self._bar_args is not None:
            from tqdm.auto import tqdm
            self._bar = tqdm(initial=initial, **self._bar_args)
        return self._bar

    def log(self, step: int, metrics: Mapping[str, object]) -> dict:
        """Record ``metrics`` (name -> scalar) for ``step``; returns the JSON row written."""
        row = {"step": int(step)}
        row.update({k: to_python(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, int(step))
        bar = self._ensure_bar(initial=int(step) - 1)
        if bar is not None:
            bar.set_postfix({k: f"{row[k]:.4g}" for k in _BAR_KEYS if isinstance(row.get(k), (int, float))},
                            refresh=False)
            bar.update(int(step) - bar.n)
        return row

    def skip_to(self, step: int) -> None:
        """Start the progress bar at ``step`` (a resumed run)."""
        self._ensure_bar(initial=step)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def read_metrics(path: str) -> list[dict]:
    """Rows of a ``metrics.jsonl`` file (or a run directory containing one), one per step: when a resumed run
    re-did steps, the last row written for a step wins; rows are sorted by step.

    Raises:
      FileNotFoundError: no metrics file at ``path``.
      ValueError: a line that is not JSON (names the file and line number).
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file: {path}")
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON line ({e})") from e
    last = {r.get("step"): r for r in rows}
    return [last[k] for k in sorted(last, key=lambda k: (k is None, k or 0))]
