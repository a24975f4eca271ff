"""Per-step metrics of a run: one JSON object per line in ``metrics.jsonl`` (always), and as chosen by
``trainer.logger`` (verl's key): TensorBoard event files (tensorboardX, ``tensorboard``), Weights & Biases
(``wandb``; ``WANDB_MODE=offline`` writes a local run under ``<run_dir>/wandb`` without any network, to be
``wandb sync``-ed later) and a tqdm progress bar on the console (``console``)."""
from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Mapping, Optional

import numpy as np

log = logging.getLogger(__name__)

# shown in the progress bar, in this order, when present
_BAR_KEYS = ("reward/mean", "acc/mean", "entropy", "s2t/masked_frac", "response_length/mean", "loss")


def to_python(v):
    """A JSON-friendly float/int from a Python, NumPy or JAX scalar (non-finite floats become null).
    Raises: ValueError for a non-scalar. Source: the metrics.jsonl convention (JSON has no NaN)."""
    v = np.asarray(v)
    if v.size != 1:
        raise ValueError(f"metric value must be a scalar, got shape {v.shape}")
    v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def progress_bar(total: Optional[int], desc: str, *, unit: str = "step", enabled: bool = True):
    """A tqdm progress bar on stderr (count, rate, ETA) for a long phase (SFT steps, evaluated problems), shown
    only on JAX process 0 of a multi-controller run; elsewhere, or with ``enabled`` false, a disabled tqdm
    whose ``update`` / ``set_postfix`` / ``write`` / ``close`` do nothing.

    Args:
      total: number of units (None: unknown, no ETA); desc: the label in front; unit: e.g. ``"step"``.
    Returns:
      a ``tqdm.auto.tqdm`` (use as a context manager or call ``close()``).
    Never raises. Source: verl's ``trainer.logger: console`` progress bar.
    """
    import jax
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True,
                disable=not enabled or jax.process_index() != 0)


class MetricsLogger:
    """Write scalar metrics per step.

    Args:
      run_dir: directory for ``metrics.jsonl`` and ``tb/`` (created).
      total_steps: length of the progress bar (steps).
      tensorboard: write TensorBoard events under ``run_dir/tb``.
      progress: show a tqdm progress bar on stderr.
      wandb: keyword arguments of ``wandb.init`` (e.g. ``project``, ``name``, ``config``) to also log to
        Weights & Biases (files under ``run_dir/wandb``), or None. ``WANDB_MODE=offline`` needs no network.
    Raises:
      ImportError: ``wandb`` requested but not installed (the message says how to install it).
    """

    def __init__(self, run_dir: str, total_steps: Optional[int] = None, *, tensorboard: bool = True,
                 progress: bool = True, desc: str = "train", wandb: Optional[Mapping] = None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        _drop_partial_last_line(self.path)
        self._file = open(self.path, "a", buffering=1)
        self._tb = None  # created on first use, so that a resumed run opens it with its purge step
        self._tb_dir = os.path.join(run_dir, "tb") if tensorboard else None
        self._tb_purge_step: Optional[int] = None
        self._wandb = _start_wandb(run_dir, wandb) if wandb is not None else None
        self._bar = None  # created at the first step, so warm-up phases do not count towards its rate
        self._bar_args = dict(total=total_steps, desc=desc, dynamic_ncols=True) if progress else None
        self.progress = bool(progress)  # whether this process shows progress bars (phases outside RL follow it)

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
        tb = self._writer()
        if tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    tb.add_scalar(k, v, int(step))
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=int(step))
        bar = self._ensure_bar(initial=int(step) - 1)
        if bar is not None:
            bar.set_postfix({k: f"{row[k]:.4g}" for k in _BAR_KEYS if isinstance(row.get(k), (int, float))},
                            refresh=False)
        self.advance(step)
        return row

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step`` without logging a row (steps between ``log_every`` rows)."""
        bar = self._ensure_bar(initial=int(step) - 1)
        if bar is not None:
            bar.update(int(step) - bar.n)

    def close_progress(self) -> None:
        """Finish the progress bar (later :meth:`write` lines print plainly instead of redrawing it)."""
        if self._bar is not None:
            self._bar.close()
        self._bar, self._bar_args = None, None

    def _writer(self):
        if self._tb is None and self._tb_dir is not None:
            from tensorboardX import SummaryWriter
            # a file of its own (the name holds whole seconds: a resume within the same second would overwrite)
            self._tb = SummaryWriter(self._tb_dir, purge_step=self._tb_purge_step,
                                     filename_suffix=f".{time.time_ns()}")
        return self._tb

    def skip_to(self, step: int) -> None:
        """A run resumed from the checkpoint of ``step`` (int): drop the rows of later steps from
        ``metrics.jsonl`` (the interrupted run wrote them, the resumed run writes them again), open TensorBoard
        with ``purge_step = step + 1`` (TensorBoard then hides the earlier events of those steps) and start the
        progress bar at ``step``. Raises: OSError when the metrics file cannot be rewritten. Source:
        TensorBoard's ``purge_step`` (``SummaryWriter``) for resumed runs."""
        self._file.close()
        dropped = truncate_rows(self.path, step)
        if dropped:
            log.info("%s: dropped %d row(s) after the restored step %d (the resumed run writes them again)",
                     self.path, dropped, step)
        self._file = open(self.path, "a", buffering=1)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._tb_purge_step = int(step) + 1
        self._ensure_bar(initial=step)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Finish the progress bar, flush and close TensorBoard, W&B and ``metrics.jsonl``."""
        self.close_progress()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        self._file.close()

    @classmethod
    def from_config(cls, run_dir: str, cfg, *, main_process: bool = True) -> "MetricsLogger":
        """The logger ``trainer.logger`` asks for: ``console`` (progress bar), ``tensorboard``, ``wandb``
        (project ``trainer.project_name``, run name ``trainer.experiment_name`` or the run directory's name, the
        resolved config attached). Only the main process (JAX process 0) shows a bar or writes TensorBoard /
        W&B; every process writes its ``metrics.jsonl``.

        Args:
          run_dir: this process's metrics directory; cfg: the run :class:`~stapo_jax.config.schema.Config`.
        """
        t = cfg.trainer
        chosen = set(t.logger)
        wandb = None
        if main_process and "wandb" in chosen:
            name = t.experiment_name or os.path.basename(os.path.normpath(t.run_dir))
            wandb = dict(project=t.project_name, name=name,
                         config=cfg.to_dict())
        return cls(run_dir, t.total_steps, tensorboard=main_process and "tensorboard" in chosen,
                   progress=main_process and "console" in chosen, wandb=wandb)


def _start_wandb(run_dir: str, init_kwargs: Mapping):
    """``wandb.init(dir=run_dir, **init_kwargs)``; the run object."""
    try:
        import wandb
    except ImportError as e:
        raise ImportError("trainer.logger includes wandb but the wandb package is not installed: "
                          "pip install wandb (or drop wandb from trainer.logger)") from e
    return wandb.init(dir=run_dir, **{"reinit": "create_new", **dict(init_kwargs)})


def _drop_partial_last_line(path: str) -> None:
    """Cut a metrics file back to its last newline: a run killed mid-write leaves an unterminated row, and a
    resumed run appending after it would glue its first row onto it (a corrupt line in the middle)."""
    if not os.path.isfile(path):
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if not size:
            return
        f.seek(max(size - 1, 0))
        if f.read(1) == b"\n":
            return
        f.seek(0)
        keep = f.read().rfind(b"\n") + 1
        f.truncate(keep)
    log.warning("%s: dropped a half-written last line (%d bytes) before appending", path, size - keep)


def truncate_rows(path: str, step: int) -> int:
    """Rewrite the metrics file ``path`` without the rows of steps after ``step`` (int); lines that are not such
    rows are kept as they are. Returns how many rows were dropped (0 for a missing file). Raises:
    OSError when the file cannot be rewritten (written to ``path + ".tmp"``, then renamed over it). Source: the
    metrics.jsonl the trainer writes (one JSON object with an integer ``"step"`` per line)."""
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)

    def later(raw: bytes) -> bool:
        try:
            row = json.loads(raw)
        except ValueError:
            return False
        return isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step

    keep = [raw for raw in lines if not later(raw)]
    if len(keep) == len(lines):
        return 0
    with open(path + ".tmp", "wb") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
    return len(lines) - len(keep)


def read_metrics(path: str) -> list[dict]:
    """Rows of a ``metrics.jsonl`` file (or a run directory containing one), one per step: when a resumed run
    re-did steps, the last row written for a step wins; rows are sorted by step.

    Args:
      path: a run directory (``path/metrics.jsonl`` is read) or the metrics file itself.
    Returns:
      one dict per step (``"step"``: int, metric name -> number or None), sorted by step.
    Raises:
      FileNotFoundError: no metrics file at ``path``.
      ValueError: a line that is not JSON, not a JSON object, or has no integer ``"step"`` (names the file and
        line number). Only a half-written *last* line (no trailing newline: the run was killed mid-write) is
        skipped, with a logged warning.
    Source: the metrics.jsonl the trainer writes (``MetricsLogger``).
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics file: {path}")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    rows = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as e:  # JSONDecodeError or a bad UTF-8 byte
            if i == len(lines):  # split() leaves the unterminated tail last: a row cut off mid-write
                log.warning("%s:%d: skipping a half-written last line (%d bytes; the run was stopped while "
                            "writing it)", path, i, len(raw))
                continue
            raise ValueError(f"{path}:{i}: not a JSON line ({e})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: expected one JSON object per line, got a JSON {type(row).__name__}")
        if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
            raise ValueError(f"{path}:{i}: the row has no integer 'step' (got {row.get('step')!r})")
        rows.append(row)
    last = {r["step"]: r for r in rows}
    return [last[k] for k in sorted(last)]
