"""Files of an RL run directory (``trainer.run_dir``): the resume check against the saved ``config.yaml``,
``summary.json`` and plots at the end, the opt-in experience dump; plus the validation split and the SFT
warm-up the loop runs before RL.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional, Sequence

import numpy as np
import yaml

from stapo_jax.config.schema import Config
from stapo_jax.core.errors import ConfigError
from stapo_jax.data.prompts import load_prompt_dataset
from stapo_jax.train.metrics import MetricsLogger

log = logging.getLogger(__name__)


DUMP_ENV = "STAPO_DUMP_EXPERIENCE_DIR"


def dump_experience(directory: str, step: int, exp) -> None:
    """``<directory>/step_<step>.npz``: the packed rollout (``input_ids``, ``response_mask``, ...), ``rewards``
    and ``advantages`` of an RL step, written by process 0 when ``$STAPO_DUMP_EXPERIENCE_DIR`` is set.
    The arrays keep their dtypes (int32 ids, bool masks, float32 rewards ``[N]`` / advantages ``[N, R]``). Raises:
    OSError when the directory cannot be written."""
    os.makedirs(directory, exist_ok=True)
    np.savez(os.path.join(directory, f"step_{step}.npz"), rewards=exp.rewards, **exp.arrays)


def check_run_dir(run_dir: str, create: bool = False) -> None:
    """``trainer.run_dir`` can be written: the folder, or where it is missing the nearest existing folder above
    it, is a writable directory (``os.access``; nothing is written unless ``create``). With ``create`` the
    folder is also made (``os.makedirs``), and an OSError of that (EACCES, EPERM which ``os.access`` cannot
    foresee, ENOENT from a pseudo file system such as ``/proc``) is turned into the same one-line error.

    Takes a str path. Raises: ConfigError naming ``trainer.run_dir``, the path and the folder that
    refused it (the CLI prints it as one line, exit 2, like every other path error). Source: the run directory
    layout (README, "What ``make run`` shows")."""
    def refuse(folder: str, why: str):
        raise ConfigError(f"trainer.run_dir={run_dir}: cannot write there ({folder}: {why}); choose a writable "
                          f"trainer.run_dir")

    folder = os.path.abspath(run_dir)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        refuse(folder, "not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        refuse(folder, "permission denied")
    if create:
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:  # EACCES / EPERM, or a folder that refuses new entries (e.g. under /proc)
            refuse(e.filename or run_dir, e.strerror or "permission denied")


# model keys that change how the weights are computed with, not which weights a checkpoint holds (the attention
# kernel and the remat policy give the same parameter tree: a resume may switch them)
RUNTIME_MODEL_KEYS = ("use_remove_padding", "attention", "remat", "scan_unroll")


def check_same_model(cfg: Config, run_dir: str) -> None:
    """A resumed run must build the model its checkpoints hold (else Orbax fails deep inside restore).
    Raises: ConfigError naming the model keys that differ. Source: Orbax restore needs the saved
    parameter tree."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = (yaml.safe_load(f) or {}).get("model", {})
    now = cfg.to_dict()["model"]
    diff = [f"model.{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k) and k not in RUNTIME_MODEL_KEYS]
    if diff:
        raise ConfigError(f"trainer.run_dir={run_dir} holds checkpoints of a different model ({'; '.join(diff)}); "
                          f"use a new trainer.run_dir or trainer.resume=false")


# what an RL run writes into its run directory (besides exports of other commands: sft_hf/, eval/)
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "tb", "wandb", "plots", "summary.json", "config.yaml",
               "config_history", "hf", "hf.old")


def earlier_run_outputs(run_dir: str) -> list[str]:
    """The names in ``run_dir`` that an earlier RL run wrote (``RUN_OUTPUTS`` and the ``process_<i>`` metrics
    folders of other processes), sorted; [] unless the folder holds a run's ``metrics.jsonl`` or a non-empty
    ``checkpoints/`` (so a user's own ``config.yaml`` or ``plots/`` beside no run, e.g. ``trainer.run_dir=.``,
    stays put). A missing ``run_dir`` is not an error (it has none). Source: the files the trainer writes
    (README, "What ``make run`` shows": what it leaves in ``runs/tiny_cpu/``)."""
    try:
        names = set(os.listdir(run_dir))
        ckpt = os.path.join(run_dir, "checkpoints")
        ran = "metrics.jsonl" in names or (os.path.isdir(ckpt) and bool(os.listdir(ckpt)))
    except OSError:
        return []
    if not ran:
        return []
    return sorted(n for n in names if n in RUN_OUTPUTS or (n.startswith("process_") and n[len("process_"):].isdigit()))


def _new_folder(run_dir: str) -> str:
    """A fresh ``<run_dir>/replaced-<UTC YYYYmmdd-HHMMSS>[-k]`` folder (created; ``-k`` when that second's exists)."""
    base = os.path.join(run_dir, f"replaced-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    for k in range(1000):
        path = base if k == 0 else f"{base}-{k}"
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            continue
    raise OSError(f"cannot create a new {base}-<k> folder in {run_dir}")


def set_aside_earlier_run(run_dir: str, main_process: bool) -> Optional[str]:
    """``trainer.resume=false`` in a run directory an earlier run wrote to: move that run's outputs
    (:func:`earlier_run_outputs`: checkpoints, ``metrics.jsonl``, ``tb/``, plots, summary, config, HF export) into
    ``<run_dir>/replaced-<UTC YYYYmmdd-HHMMSS>/`` (process 0; nothing is deleted; ``-1``, ``-2`` ... appended when
    that second's folder exists), so the fresh run's checkpoints and metrics do not mix with the earlier run's: a
    resume would otherwise load the earlier run's later steps as this run's, and ``metrics.jsonl`` would hold both
    runs' rows.

    A collective when ``jax.process_count() > 1``: every process calls it (two barriers, so no
    process opens its checkpointer or metrics file before the move). Returns the new folder on process 0 when
    something was moved, else None. Raises OSError when the folder or a move fails (e.g. a read-only run
    directory; the other processes then stop at the second barrier's timeout).
    Source: verl's ``trainer.resume_mode=disable`` starts fresh; the move keeps the earlier run's files.
    """
    import jax
    from jax.experimental import multihost_utils

    def barrier(name: str) -> None:
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"stapo_jax run_dir: resume=false {name}")

    names = earlier_run_outputs(run_dir) if main_process else []
    barrier("check")
    target = _new_folder(run_dir) if names else None
    if target:
        for name in names:
            os.replace(os.path.join(run_dir, name), os.path.join(target, name))
        log.warning("trainer.resume=false: moved the earlier run's %s from %s to %s (this run starts fresh; a "
                    "later resume cannot load the earlier run's steps)", ", ".join(names), run_dir, target)
    barrier("moved")
    return target


def load_val_examples(cfg: Config, tok) -> list[dict]:
    """The validation prompts (``data.gym.val_size`` or ``data.val_files``), or [] when none are configured.
    Raises: FileNotFoundError / ConfigError from the dataset loader (``stapo_jax.data.prompts``). Source: verl's
    ``data.val_files``. Returns dicts of str (prompt text and gold)."""
    has_val = cfg.data.gym.val_size if cfg.data.source == "gym" else bool(cfg.data.val_files)
    return load_prompt_dataset(cfg, tok, "val").examples if has_val else []


def sft_warmup(cfg: Config, model, examples: Sequence[dict], tok, logger: MetricsLogger, should_stop=None) -> bool:
    """``sft.steps`` supervised steps on ``examples`` (updates ``model`` in place) and one log line of the loss.
    Returns False when ``should_stop`` (asked every 10 steps, ``sft.run_sft``) ended it early, else True.
    Takes examples: dicts of text. Raises what ``stapo_jax.train.sft.sft_from_config`` raises
    (ConfigError). Source: stapo_spec.md (optional SFT warm-up before RL)."""
    from stapo_jax.train.sft import sft_from_config

    hist = sft_from_config(cfg, model, examples, tok, progress=logger.progress, should_stop=should_stop)
    n, total = len(hist), cfg.sft.steps
    done = f"{total} steps" if n == total else f"stopped after {n} of {total} steps"
    logger.write(f"SFT warm-up: {done}, loss {hist[0]['sft/loss']:.3f} -> {hist[-1]['sft/loss']:.3f}")
    return len(hist) == cfg.sft.steps


def write_plots(run_dir: str, summary: dict) -> None:
    """The run's plots (``plots.plot_run``) into ``run_dir``; their paths go to ``summary['plots']``.
    Never raises for an empty run (logs a warning); OSError when ``run_dir`` cannot be written. Source:
    ``stapo_jax.train.plots``. summary: a dict of JSON-able values (float, int, str)."""
    from stapo_jax.train.plots import plot_run
    try:
        summary["plots"] = plot_run(run_dir, summary=summary)   # held-out accuracy from the before-RL point
    except ValueError as e:  # no metrics rows (e.g. preempted before the first step)
        log.warning("no plots: %s", e)


def earlier_summary(run_dir: str) -> dict:
    """What ``summary.json`` of ``run_dir`` holds (e.g. ``heldout_acc_before``, written as soon as it is measured,
    so a run killed later still has it), or {} when there is none. Returns JSON values. Raises:
    json.JSONDecodeError for a corrupt summary.json. Source: the run directory layout (README)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write_summary(run_dir: str, summary: dict) -> None:
    """``summary.json``; a resumed run keeps what earlier runs recorded (e.g. the accuracy before RL).
    Takes JSON-able values. Raises: OSError / json.JSONDecodeError for an unwritable dir or a corrupt
    summary.json. Source: the run directory layout (README)."""
    previous = earlier_summary(run_dir)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({**previous, **summary}, f, indent=2, default=str)
