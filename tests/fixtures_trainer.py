"""Shared helpers of the end-to-end trainer tests: a tiny run config, ``stapo-jax`` in a subprocess, and readers
for what a run leaves behind (metrics rows, Orbax checkpoints, HF exports).

Runs go through ``python -m stapo_jax`` in a child process so that the command line, signal handling and
process exit codes are what a user gets. The child sees ``devices`` simulated CPU devices (set in its
environment, independent of the 8 that tests/conftest.py gives the test process).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import yaml
from xla_env import xla_flags

REPO = Path(__file__).resolve().parents[1]

# A 1-layer D=32 Qwen3 over the builtin character tokenizer on 1-digit additions (answers 0..18). 100 SFT steps
# at lr 5e-3 teach it the answer format, so RL starts with non-zero reward (partial credit from reasoning-gym's
# basic_arithmetic scorer) and non-zero policy gradients.
TINY_CONFIG = {
    "model": {"preset": None, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "tie_word_embeddings": True,
              "rope_theta": 10000.0, "max_position_embeddings": 128, "dtype": "float32", "param_dtype": "float32"},
    "tokenizer": {"kind": "builtin"},
    "data": {"source": "gym", "apply_chat_template": False, "prompt_suffix": "", "max_prompt_length": 32,
             "gym": {"task": "basic_arithmetic", "size": 64, "val_size": 8, "seed": 1,
                     "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                "operators": ["+"], "allow_parentheses": False, "allow_negation": False}}},
    "rollout": {"n": 4, "max_new_tokens": 6, "max_concurrent_decodes": 16},
    "algorithm": {"recipe": "stapo"},
    "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size": 4, "logprob_seq_chunk": 32,
              "optim": {"lr": 1.0e-3, "warmup_steps": 0, "weight_decay": 0.0}},
    "reward": {"kind": "gym", "gym_answer_format": "raw", "num_workers": 1},
    "trainer": {"total_steps": 3, "train_batch_size": 4, "save_every": 1, "keep_checkpoints": 10},
    "sft": {"steps": 100, "batch_size": 32, "lr": 5.0e-3, "warmup_steps": 0},
}


def write_config(path: Path, run_dir: Path, base: Optional[dict] = None, **sections) -> Path:
    """Write ``base`` (default :data:`TINY_CONFIG`) with ``trainer.run_dir = run_dir`` and per-section updates
    (``trainer={"total_steps": 4}``) as YAML at ``path``; returns ``path``."""
    cfg = json.loads(json.dumps(base or TINY_CONFIG))
    cfg.setdefault("trainer", {})["run_dir"] = str(run_dir)
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def child_env(devices: int = 1) -> dict:
    """Environment of a ``stapo-jax`` child: CPU JAX with ``devices`` simulated devices, offline HF."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def cli_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "stapo_jax", *args]


def run_cli(*args: str, devices: int = 1, timeout: float = 900, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run ``python -m stapo_jax ARGS`` to completion in ``cwd``; stdout/stderr captured as text."""
    return subprocess.run(cli_args(*args), cwd=cwd, env=child_env(devices), capture_output=True, text=True,
                          timeout=timeout)


def start_cli(*args: str, log_path: Path, devices: int = 1, cwd: Path = REPO) -> subprocess.Popen:
    """Start ``python -m stapo_jax ARGS`` in the background, stdout+stderr to ``log_path``."""
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cli_args(*args), cwd=cwd, env=child_env(devices), stdout=log,
                                stderr=subprocess.STDOUT)
    finally:
        log.close()


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Steps whose Orbax checkpoint directory is committed (a plain integer name: Orbax writes into a
    ``<step>.orbax-checkpoint-tmp-*`` directory and renames it on commit)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.is_dir() and p.name.isdigit())


def wait_for_checkpoint(proc: subprocess.Popen, ckpt_dir: Path, step: int, timeout: float, log_path: Path) -> None:
    """Poll until ``step`` is committed in ``ckpt_dir``; fail (with the child's log) if the child exits first
    or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while step not in committed_steps(ckpt_dir):
        if proc.poll() is not None:
            raise AssertionError(f"run exited with {proc.returncode} before checkpoint {step}:\n"
                                 f"{log_path.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"no checkpoint {step} after {timeout} s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.05)


def metrics_by_step(run_dir: Path) -> dict[int, dict]:
    """The last ``metrics.jsonl`` row of each step (a resumed run appends; re-run steps replace earlier rows)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in rows}


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def restore_raw(ckpt_dir: Path, step: int) -> tuple[dict, dict, dict]:
    """(state, data, meta) of committed ``step``, restored by Orbax without a target (NumPy-convertible
    arrays, the tree as saved: ``{"train": {"params", "opt_state", "step"}, "rng"}``)."""
    import orbax.checkpoint as ocp

    mngr = ocp.CheckpointManager(str(ckpt_dir))
    try:
        out = mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    finally:
        mngr.close()
    return out["state"], dict(out["data"] or {}), dict(out["meta"] or {})


def flat_arrays(tree) -> dict[str, np.ndarray]:
    """``{"a/b/c": np.ndarray}`` of a nested dict/list tree."""
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Max |a - b| over equally named arrays; the names and shapes must agree."""
    assert sorted(a) == sorted(b), (sorted(set(a) ^ set(b)))
    out = 0.0
    for k in a:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        if a[k].size:
            out = max(out, float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))))
    return out


def load_safetensors_dir(path: Path) -> dict[str, np.ndarray]:
    """All tensors of the ``*.safetensors`` files in ``path``."""
    from safetensors.numpy import load_file

    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"no safetensors in {path}"
    return out


# metrics whose values are wall-clock measurements (never compared between runs)
TIMING_PREFIXES: Sequence[str] = ("time/", "perf/", "rollout/tokens_per_s")


def deterministic_part(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(tuple(TIMING_PREFIXES))}
