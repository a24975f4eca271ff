"""Batch settings against the devices (issue 43): every batch-shape error of a run, found together once the mesh
is known, as one error with the nearest values that work: the RL mini-batch over the data-parallel shards
(``actor.ppo_mini_batch_size`` x ``rollout.n``), its micro-batches (``actor.ppo_micro_batch_size``; ``auto``
always fits) and the SFT warm-up's batch (``sft.batch_size``). In a multi-process run only process 0 lists them;
the others say where to look.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax

from stapo_jax.config.schema import Config, micro_batch_count
from stapo_jax.core.errors import ConfigError
from stapo_jax.train.micro_batches import data_parallel_size


def nearest(value: int, ok: Callable[[int], bool], limit: int = 1 << 16) -> list[int]:
    """The nearest ints >= 1 below and above ``value`` for which ``ok`` holds (each side when one exists within
    ``limit``), sorted. Ints in, a list of ints out; never raises. Source: a linear search outward."""
    below = next((v for v in range(value - 1, 0, -1) if ok(v)), None)
    above = next((v for v in range(value + 1, value + limit) if ok(v)), None)
    return [v for v in (below, above) if v is not None]


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values) or "none nearby"


def batch_shape_errors(cfg: Config, dp: int, sft: bool) -> list[str]:
    """Every batch-shape problem of ``cfg`` over ``dp`` data-parallel shards (``sft``: the SFT warm-up runs), each
    one sentence naming the key, its value and the nearest values that work; [] when all fit. Ints / bools in,
    a list of str out; never raises. Source: the trainer's rule (``config.schema.micro_batch_count``), verl's rule that
    a batch divides the data-parallel size."""
    a, n, errors = cfg.actor, cfg.rollout.n, []
    rows = a.ppo_mini_batch_size * n
    if rows % dp:
        fits = nearest(a.ppo_mini_batch_size, lambda m: (m * n) % dp == 0)
        errors.append(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} x rollout.n={n} = {rows} sequences do "
                      f"not split into {dp} data-parallel shards: nearest actor.ppo_mini_batch_size that does: "
                      f"{_either(fits)} (trainer.train_batch_size a multiple of it)")
    elif micro_batch_count(rows, dp, a.ppo_micro_batch_size) is None:
        per = rows // dp
        fits = nearest(a.ppo_micro_batch_size, lambda m: micro_batch_count(rows, dp, m) is not None, limit=per + 1)
        errors.append(f"actor.ppo_micro_batch_size={a.ppo_micro_batch_size} does not divide the {per} sequences a "
                      f"shard gets per mini-batch: nearest that does: {_either(fits)} (or auto)")
    if sft and cfg.sft.batch_size % dp:
        fits = nearest(cfg.sft.batch_size, lambda b: b % dp == 0)
        errors.append(f"sft.batch_size={cfg.sft.batch_size} does not split into {dp} data-parallel shards: nearest "
                      f"that does: {_either(fits)}")
    return errors


def check_batch_shapes(cfg: Config, mesh, sft: Optional[bool] = None) -> int:
    """K, the micro-batches per mini-batch (``config.schema.micro_batch_count``), once every batch setting of ``cfg``
    fits the data-parallel shards of ``mesh`` (``mesh.data`` x ``mesh.fsdp`` over all processes).

    ``sft`` (default ``cfg.sft.steps > 0``): check ``sft.batch_size`` too. Returns a Python int.
    Raises: ConfigError with every problem in one line (:func:`batch_shape_errors`) on process 0, a short
    pointer to it on the others. Source: issue 43 (one error at a time, once per process, named no fix)."""
    dp = data_parallel_size(mesh)
    errors = batch_shape_errors(cfg, dp, bool(cfg.sft.steps) if sft is None else sft)
    if errors:
        if jax.process_index() > 0:
            raise ConfigError("the batch settings do not fit the devices (process 0 lists what to change)")
        raise ConfigError(f"the batch settings do not fit {dp} data-parallel shards ({jax.process_count()} processes "
                          f"x {jax.local_device_count()} devices, mesh.data x mesh.fsdp): " + "; ".join(errors))
    return int(micro_batch_count(cfg.actor.ppo_mini_batch_size * cfg.rollout.n, dp, cfg.actor.ppo_micro_batch_size))
