"""A run directory belongs to one run (issue 43): an exclusive lock while a run uses it, a history of the settings
each start used, and what a resumed run may change.

* :class:`RunDirLock`: ``<run_dir>/.lock``, an exclusive ``flock`` held by process 0 for the whole run; a second
  run on the same directory stops at once with one line naming the holder's pid and host. The kernel drops the
  lock when its holder dies, so a killed run leaves no stale lock. Filesystems without ``flock`` (some FUSE
  mounts) get a warning and no lock.
* :func:`record_start`: every start writes ``config_history/<UTC time>-<fresh|resume>.yaml`` (the settings it
  ran with); ``config.yaml`` is written by a fresh start only and afterwards only takes a larger
  ``trainer.total_steps``: it always describes the run its checkpoints belong to.
* :func:`check_resume_settings`: a resume whose settings differ from ``config.yaml`` in a key outside
  :data:`RESUMABLE_KEYS` (the learning rate, the recipe, the model, the data, ...) is refused with one line listing
  the keys. ``trainer.total_steps`` may change: larger extends the run, smaller (or equal to the last checkpoint)
  ends it at once with a note (``trainer.py``).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
import warnings
from typing import Any, Optional

import yaml

from stapo_jax.config.schema import Config, from_dict
from stapo_jax.core.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
HISTORY_DIR = "config_history"
CONFIG_NAME = "config.yaml"
# settings a resumed run may change: where and how it runs, logs and checkpoints, not what it computes (the
# attention kernel, remat and packing give the same parameters; micro-batches the same gradient up to rounding;
# the mesh is restored into; SFT does not run again on a resume; eval.* is read by `stapo-jax eval` only;
# actor.use_kl_loss is checked against the checkpoint itself, trainer.check_kl_reference, with its own message)
RESUMABLE_KEYS = (
    "trainer.total_steps", "trainer.run_dir", "trainer.resume", "trainer.log_every", "trainer.save_every",
    "trainer.keep_checkpoints", "trainer.eval_every", "trainer.export_hf", "trainer.logger", "trainer.project_name",
    "trainer.experiment_name", "trainer.compilation_cache_dir", "trainer.precompile", "trainer.stall_timeout_s",
    "model.use_remove_padding", "model.attention", "model.remat", "model.scan_unroll",
    "actor.ppo_micro_batch_size", "actor.use_kl_loss", "sft.", "eval.", "mesh.",
    "reward.timeout_s", "reward.num_workers", "reward.max_pool_restarts",
    "rollout.max_concurrent_decodes", "rollout.prefill_batch_size")


class RunDirLock:
    """An exclusive, advisory lock on ``run_dir`` (``<run_dir>/.lock``, ``fcntl.flock``), holding the holder's pid,
    host and start time. :meth:`acquire` raises ConfigError when another process holds it; :meth:`release` (or
    the process's end) frees it. ``run_dir`` must exist. Source: ``flock(2)``; the pid-file convention."""

    def __init__(self, run_dir: str):
        self.run_dir, self.path, self._fd = run_dir, os.path.join(run_dir, LOCK_NAME), None

    def acquire(self) -> "RunDirLock":
        """Take the lock; returns self. Raises: ConfigError naming ``trainer.run_dir``, the holder's pid and host
        (one line, the CLI's exit 2); OSError when the lock file cannot be opened. Source: ``flock(2)``."""
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"trainer.run_dir={self.run_dir} is in use by another run (pid {holder.get('pid', '?')} "
                              f"on {holder.get('host', '?')}, started {holder.get('started', '?')}): wait for it "
                              f"to end or choose another trainer.run_dir") from None
        except OSError as e:  # no flock on this filesystem (some FUSE mounts): run unlocked, say so
            log.warning("trainer.run_dir=%s: cannot lock %s (%s); two runs on this directory would not be stopped",
                        self.run_dir, self.path, e)
            os.close(fd)
            return self
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Free the lock (the file stays, emptied). Idempotent; never raises."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            finally:
                os.close(self._fd)  # closing the descriptor drops the flock
                self._fd = None


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def claim_run_dir(run_dir: str, main_process: bool, stack) -> None:
    """Lock ``run_dir`` for this run (process 0, :class:`RunDirLock`, released when ``stack`` closes). A
    collective when ``jax.process_count() > 1``: all processes learn whether process 0 got it. Raises ConfigError
    (process 0: naming the holder; the others: pointing at process 0's log). Source: this module's design."""
    from stapo_jax.runtime.collectives import allgather_max

    error: Optional[ConfigError] = None
    if main_process:
        try:
            stack.callback(RunDirLock(run_dir).acquire().release)
        except ConfigError as e:
            error = e
    if allgather_max(float(error is not None)) > 0:
        raise error or ConfigError(f"trainer.run_dir={run_dir} is in use by another run (process 0 names it)")


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "config":  # data.gym.config is one value (a task's own settings)
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def saved_config(run_dir: str) -> Optional[dict]:
    """The run's ``config.yaml`` as a nested dict, or None without one. Raises yaml.YAMLError for a damaged file.
    Source: ``Config.save``."""
    path = os.path.join(run_dir, CONFIG_NAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return yaml.safe_load(f) or {}


def changed_keys(saved: dict, now: dict) -> list[str]:
    """Dotted keys whose values differ between two nested config dicts, sorted (a key missing from either side,
    e.g. one added by a later version, is not a difference). Plain dicts in, a list of str out; never raises.
    Source: ``Config.to_dict`` / ``config.yaml`` (YAML's plain types on both sides)."""
    a, b = _flat(saved), _flat(yaml.safe_load(yaml.safe_dump(now)))
    return sorted(k for k in set(a) & set(b) if a[k] != b[k])


def normalised_config(saved: dict) -> dict:
    """``saved`` (a ``config.yaml`` as a nested dict) read through the current loader and written back
    (``from_dict(saved).to_dict()``), so that a file written by an older version compares equal to the same settings
    written now: e.g. ``actor.token_mask: null`` with ``s2t.enabled: true`` becomes ``actor.token_mask: s2t`` (the
    older spelling's FutureWarning is not shown). A file the current loader refuses (a key removed since, a
    check added since) is returned as it is (then compared key by key, as :func:`changed_keys` does). Plain dicts
    in and out; never raises (but as the registries' import). Source: ``Config.to_dict`` / ``config.yaml``."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*\.enabled is deprecated", category=FutureWarning)
            return from_dict(saved).to_dict()
    except ConfigError:
        return saved


def resumable(key: str) -> bool:
    """True for a key a resumed run may change (:data:`RESUMABLE_KEYS`; an entry ending in ``.`` is a section).
    A dotted str in, a bool out; never raises. Source: this module's :data:`RESUMABLE_KEYS`."""
    return any(key == r or (r.endswith(".") and key.startswith(r)) for r in RESUMABLE_KEYS)


def check_resume_settings(cfg: Config, run_dir: str) -> list[str]:
    """Before a resume: the keys where ``cfg`` differs from the run's ``config.yaml`` (sorted; [] without one).
    Raises: ConfigError, one line listing each refused key as ``key saved -> now`` and the ways on (a new
    ``trainer.run_dir``, ``trainer.resume=false``, or accepting them in ``config.yaml``). Source: verl resumes
    with the config it is given; here a run directory holds one run. ``config.yaml`` is compared as the current
    loader reads it (:func:`normalised_config`: an older spelling of the same settings is no difference)."""
    saved = saved_config(run_dir)
    if saved is None:
        return []
    saved = normalised_config(saved)
    now = cfg.to_dict()
    keys = changed_keys(saved, now)
    refused = [k for k in keys if not resumable(k)]
    if refused:
        a, b = _flat(saved), _flat(now)
        diff = "; ".join(f"{k} {a[k]!r} -> {b[k]!r}" for k in refused)
        raise ConfigError(f"trainer.run_dir={run_dir} holds a run with other settings ({diff}): resume it with its "
                          f"{CONFIG_NAME}, use a new trainer.run_dir, trainer.resume=false (moves that run aside), or "
                          f"edit {os.path.join(run_dir, CONFIG_NAME)} to accept them")
    return keys


def has_checkpoints(run_dir: str) -> bool:
    """True when ``<run_dir>/checkpoints`` holds a step folder (digits; Orbax's temporary ones do not count).
    A str path in, a bool out; never raises. Source: Orbax's ``CheckpointManager`` folder layout."""
    try:
        return any(n.isdigit() for n in os.listdir(os.path.join(run_dir, "checkpoints")))
    except OSError:
        return False


def record_start(cfg: Config, run_dir: str, resuming: bool) -> str:
    """Write ``config_history/<UTC YYYYmmdd-HHMMSS>-<fresh|resume>.yaml`` with this start's settings and, for a
    fresh start, ``config.yaml``; a resume only raises ``config.yaml``'s ``trainer.total_steps`` when this start
    extends the run. Process 0 only. Returns the history file's path. Raises OSError for an unwritable folder.
    Source: this module's design (``config.yaml`` describes the checkpoints)."""
    folder = os.path.join(run_dir, HISTORY_DIR)
    os.makedirs(folder, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = os.path.join(folder, f"{stamp}-{'resume' if resuming else 'fresh'}.yaml")
    k = 0
    while os.path.exists(path):
        k += 1
        path = os.path.join(folder, f"{stamp}-{k}-{'resume' if resuming else 'fresh'}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False, width=120)
    saved = saved_config(run_dir) if resuming else None
    if saved is None:
        cfg.save(run_dir)
    elif (saved.get("trainer") or {}).get("total_steps") is not None and \
            cfg.trainer.total_steps > saved["trainer"]["total_steps"]:
        saved["trainer"]["total_steps"] = cfg.trainer.total_steps
        tmp = os.path.join(run_dir, CONFIG_NAME + ".tmp")
        with open(tmp, "w") as f:
            yaml.safe_dump(saved, f, sort_keys=False, width=120)
        os.replace(tmp, os.path.join(run_dir, CONFIG_NAME))
    return path
