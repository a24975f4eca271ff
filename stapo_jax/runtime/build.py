"""From a run config to the objects every command needs: mesh, tokenizer, model (sharded on the mesh), recipe.

Shared by ``train``, ``sft``, ``eval`` and ``serve`` so that all of them build the policy the same way (the
optimizer: ``stapo_jax.train.optim.build_optimizer``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
from flax import nnx

from models.hf import load_hf_checkpoint
from models.layer_scan import resolve_scan_unroll
from models.presets import canonical_name, from_hf_config, preset
from models.qwen3 import Qwen3
from models.qwen3_config import Qwen3Config
from models.sharding import ShardingError, make_mesh, shard_model
from stapo_jax.config.schema import MODEL_SIZE_KEYS, Config
from stapo_jax.core.errors import ConfigError
from stapo_jax.data.tokenizer import load_tokenizer, stop_token_ids


def build_mesh(cfg: Config):
    """``jax.sharding.Mesh`` with axes (data, fsdp, tensor) from ``cfg.mesh`` (-1 = the remaining devices).
    Raises: ConfigError naming ``mesh.data`` / ``mesh.fsdp`` / ``mesh.tensor`` and the device
    count when the axis sizes do not fit the devices (from ``models.sharding.ShardingError``). Source:
    ``models.sharding.make_mesh``."""
    m = cfg.mesh
    try:
        return make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor)
    except ShardingError as e:
        raise ConfigError(f"mesh.data={m.data} x mesh.fsdp={m.fsdp} x mesh.tensor={m.tensor} does not fit the "
                          f"{jax.device_count()} devices of this job (-1 takes the remaining devices): {e}") from e


def model_config(cfg: Config, tokenizer=None, platform: Optional[str] = None) -> Qwen3Config:
    """The ``Qwen3Config`` of a from-scratch or preset model (not for ``model.path``, whose config.json rules).
    ``model.scan_unroll=auto`` resolves for ``platform`` (``"cpu"`` / ``"gpu"`` / ``"tpu"``; default JAX's backend).

    The preset's numbers come first, explicit ``model.*`` size fields override them; a from-scratch model with
    no ``vocab_size`` takes ``len(tokenizer)``; EOS ids come from the tokenizer when one is given.
    Raises:
      ConfigError: neither a preset nor the required size fields.
    Takes ints / floats / str of the config. Source: the HF ``config.json`` of the Qwen3 presets.
    """
    m = cfg.model
    base = _preset_config(m.preset) if m.preset else None
    explicit = {k: getattr(m, k) for k in MODEL_SIZE_KEYS if getattr(m, k) is not None}
    if base is None:
        if "vocab_size" not in explicit and tokenizer is not None:
            explicit["vocab_size"] = len(tokenizer)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in explicit]
        if missing:
            raise ConfigError(f"model: set model.path, model.preset, or the size fields {missing}")
        base = Qwen3Config(**explicit)
    else:
        base = dataclasses.replace(base, **explicit)
    extra = dict(dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat, attention=m.attention,
                 scan_unroll=resolve_scan_unroll(m.scan_unroll, platform))
    if tokenizer is not None:
        extra["eos_token_id"] = tuple(stop_token_ids(tokenizer))
        extra["pad_token_id"] = tokenizer.pad_token_id
        extra["bos_token_id"] = None
    return dataclasses.replace(base, **extra)


def _preset_config(name: str) -> Qwen3Config:
    """A named preset from the embedded numbers, or else an HF config.json path / preset file."""
    try:
        return preset(canonical_name(name))
    except KeyError as unknown:
        if not os.path.exists(name):
            raise ConfigError(f"model.preset={name!r}: {unknown.args[0]}, and no such config.json file") from None
        return from_hf_config(name)


def build_model(cfg: Config, mesh, tokenizer=None, seed: int = 0) -> Qwen3:
    """The policy: loaded from ``model.path`` (safetensors, straight into its shardings) or randomly
    initialised from :func:`model_config`, then placed on ``mesh`` by the partition rules.

    Raises:
      ConfigError: see :func:`model_config`; CheckpointError for bad checkpoints.
    Parameters in ``model.param_dtype`` (float32 by default), sharded over ``mesh``. Source: HF Qwen3
    (``models.qwen3``).
    """
    m = cfg.model
    if m.path:
        _, model = load_hf_checkpoint(m.path, mesh=mesh, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                                      attention=m.attention, scan_unroll=resolve_scan_unroll(m.scan_unroll))
        return model
    model = Qwen3(model_config(cfg, tokenizer), rngs=nnx.Rngs(seed))
    return shard_model(model, mesh)


def build_tokenizer(cfg: Config):
    """The configured tokenizer (``stapo_jax.data.tokenizer.load_tokenizer``).
    Raises: ConfigError / OSError from ``load_tokenizer`` (missing path)."""
    return load_tokenizer(cfg)


def build_recipe(cfg: Config):
    """The :class:`stapo_jax.algo.recipes.Recipe` the resolved config describes (recipe defaults were applied by
    ``load_config``); see :func:`stapo_jax.config.recipes.recipe_from_config`.
    Raises: ConfigError for an invalid recipe setting."""
    from stapo_jax.config.recipes import recipe_from_config

    return recipe_from_config(cfg)
