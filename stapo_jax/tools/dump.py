"""Dump a verl ``DataProto`` batch or a TRL GRPO step to the ``.safetensors`` file ``stapo-jax check`` reads.

Runs in the PyTorch job (imports neither jax nor stapo_jax's algorithm; torch and safetensors only). Field names
are those of :mod:`stapo_jax.tools.check`: ``old_log_probs``, ``log_probs``, ``advantages``, ``response_mask`` and
optionally ``entropy``, ``ref_log_probs``, ``rewards`` + ``group_ids``, and reported scalars (``loss``,
``pg_loss``, ``pg_clipfrac``, ... with or without verl's ``actor/`` prefix).

verl (inside the actor update, where the current ``log_prob`` is computed)::

    from stapo_jax.tools.dump import dump_verl_batch
    dump_verl_batch(data, "step1.safetensors", log_probs=log_prob, entropy=entropy,
                    metrics={"actor/pg_loss": pg_loss.item(), **pg_metrics}, actor_config=self.config)

TRL (inside ``GRPOTrainer._compute_loss``, after ``per_token_logps, entropies`` are computed)::

    from stapo_jax.tools.dump import dump_trl_step
    dump_trl_step(inputs, per_token_logps, "step1.safetensors", entropy=entropies, metrics={"loss": loss.item()},
                  trainer=self)

then ``stapo-jax check step1.safetensors --recipe grpo``. With ``actor_config`` (verl's actor config, the
``config`` its ``compute_policy_loss_vanilla`` reads) the loss settings (:data:`LOSS_SETTING_KEYS`: clip ratios,
dual-clip ``clip_ratio_c``, ``loss_agg_mode``, ...) travel in the file's metadata and ``check`` uses them, so a
verl dump is checked with verl's ``clip_ratio_c`` (3.0 by default in verl 0.9.1) rather than the recipe's; with
``trainer`` a TRL dump carries TRL's (no dual clip, its ``loss_type`` as a ``loss_agg_mode``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import json

import numpy as np

__all__ = ["dump_verl_batch", "dump_trl_step", "group_ids_from_uids", "trl_loss_settings", "LOSS_SETTING_KEYS",
           "SETTINGS_METADATA_KEY", "TRL_LOSS_AGG_MODES"]

# verl actor keys (``verl/trainer/config/actor/actor.yaml``) that ``stapo-jax check`` takes from a dump's metadata
LOSS_SETTING_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "loss_scale_factor",
                     "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")
SETTINGS_METADATA_KEY = "stapo_jax.loss_settings"  # safetensors metadata: JSON {key: value}
# TRL 1.16 GRPOTrainer loss_type -> our loss_agg_mode (dr_grpo: loss_scale_factor = max_completion_length);
# checked against TRL's own loss in tests/algo/test_peer_parity.py
TRL_LOSS_AGG_MODES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
                      "dapo": "token-mean", "luspo": "seq-mean-token-sum"}


def _np(x) -> np.ndarray:
    """A torch tensor or array-like as a contiguous float32/int numpy array (detached, on the CPU)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.float()
        x = x.numpy()
    return np.ascontiguousarray(np.asarray(x))


def group_ids_from_uids(uids) -> np.ndarray:
    """verl's per-row prompt ``uid`` (strings or any hashable) as ``int32`` group ids ``[B]``, in order of first
    appearance. Raises ValueError for an empty array."""
    uids = list(np.asarray(uids, dtype=object).reshape(-1))
    if not uids:
        raise ValueError("uids is empty")
    index: dict[Any, int] = {}
    return np.asarray([index.setdefault(u, len(index)) for u in uids], np.int32)


def _loss_settings(config) -> dict:
    """The :data:`LOSS_SETTING_KEYS` a verl actor config (attributes, or a mapping such as an OmegaConf node) has,
    as plain JSON values."""
    def get(key):
        if isinstance(config, Mapping):
            return config.get(key, _MISSING)
        return getattr(config, key, _MISSING)

    out = {}
    for key in LOSS_SETTING_KEYS:
        v = get(key)
        if v is not _MISSING:
            out[key] = v if v is None or isinstance(v, (bool, str)) else float(v)
    return out


_MISSING = object()


def _save(tensors: dict[str, np.ndarray], metrics: Optional[Mapping[str, float]], path: str, settings=None) -> str:
    from safetensors.numpy import save_file

    out = {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    for name, value in (metrics or {}).items():
        out[name] = np.asarray(float(value), np.float32)
    save_file(out, path, metadata={SETTINGS_METADATA_KEY: json.dumps(settings)} if settings else None)
    return path


def dump_verl_batch(data, path: str, *, log_probs, entropy=None, metrics: Optional[Mapping[str, float]] = None,
                    actor_config=None) -> str:
    """Write a verl ``DataProto`` mini-batch and the current policy's ``log_probs`` to ``path``.

    Args:
      data: ``verl.protocol.DataProto`` with ``batch["old_log_probs"]``, ``batch["advantages"]`` (``[B, T]``),
        ``batch["response_mask"]`` (or ``batch["attention_mask"]`` and ``batch["responses"]``, as verl's
        ``compute_response_mask``), optionally ``batch["ref_log_prob"]``, ``batch["token_level_rewards"]`` with
        ``non_tensor_batch["uid"]`` (written as ``rewards`` / ``group_ids``).
      path: output ``.safetensors`` path. log_probs: ``[B, T]`` current log-probs (verl's ``log_prob`` in the
        actor update). entropy: ``[B, T]`` or None. metrics: reported scalars, e.g. ``{"actor/pg_loss": ...}``.
      actor_config: verl's actor config (``verl.workers.config.ActorConfig`` or its OmegaConf node); its
        :data:`LOSS_SETTING_KEYS` are written to the file's metadata for ``check``. None: no settings.
    Returns: ``path``. Raises: KeyError naming a missing batch field; ValueError for a shape mismatch.
    Source: verl 0.9.1 ``DataProto`` field names (``verl/trainer/ppo/ray_trainer.py``).
    Dtypes: floating tensors are written as float32, ``group_ids`` int32.
    """
    batch = data.batch
    keys = set(batch.keys())
    if "response_mask" in keys:
        mask = _np(batch["response_mask"])
    elif {"attention_mask", "responses"} <= keys:
        t = batch["responses"].shape[-1]
        mask = _np(batch["attention_mask"][:, -t:])
    else:
        raise KeyError("DataProto.batch has neither 'response_mask' nor 'attention_mask' + 'responses'")
    for need in ("old_log_probs", "advantages"):
        if need not in keys:
            raise KeyError(f"DataProto.batch has no {need!r} (keys: {sorted(keys)})")
    out = {"old_log_probs": _np(batch["old_log_probs"]), "log_probs": _np(log_probs),
           "advantages": _np(batch["advantages"]), "response_mask": mask.astype(np.float32)}
    if "ref_log_prob" in keys:
        out["ref_log_probs"] = _np(batch["ref_log_prob"])
    if entropy is not None:
        out["entropy"] = _np(entropy)
    if "token_level_rewards" in keys and "uid" in data.non_tensor_batch:
        out["rewards"] = _np(batch["token_level_rewards"]).sum(-1)
        out["group_ids"] = group_ids_from_uids(data.non_tensor_batch["uid"])
    for name, a in out.items():
        if name not in ("rewards", "group_ids") and a.shape[0] != mask.shape[0]:
            raise ValueError(f"{name} has {a.shape[0]} rows, response_mask {mask.shape[0]}")
    return _save(out, metrics, path, None if actor_config is None else _loss_settings(actor_config))


def trl_loss_settings(trainer) -> dict:
    """Our loss settings (:data:`LOSS_SETTING_KEYS`) for a TRL 1.16 ``GRPOTrainer`` (the attributes its
    ``_compute_loss`` reads: ``loss_type``, ``epsilon_low``, ``epsilon_high``, ``beta``, ``max_completion_length``,
    ``args.delta``): no dual clip, no log-ratio clamp needed, the KL term TRL's k3 with coefficient ``beta``.

    Returns JSON values. Raises: ValueError for a ``loss_type`` outside
    :data:`TRL_LOSS_AGG_MODES`, TRL's two-sided clipping (``args.delta``) or a sequence-level importance ratio,
    which have no counterpart here. Source: TRL 1.16 ``grpo_trainer.py`` (``_compute_loss``)."""
    if trainer.loss_type not in TRL_LOSS_AGG_MODES:
        raise ValueError(f"TRL loss_type={trainer.loss_type!r} has no counterpart; known: {sorted(TRL_LOSS_AGG_MODES)}")
    if getattr(getattr(trainer, "args", None), "delta", None) is not None:
        raise ValueError("TRL args.delta (two-sided clipping) has no counterpart in stapo-jax check")
    if getattr(trainer, "importance_sampling_level", "token") != "token":
        raise ValueError(f"TRL importance_sampling_level={trainer.importance_sampling_level!r}: only 'token' is "
                         "checked")
    beta = float(trainer.beta)
    return {"clip_ratio_low": float(trainer.epsilon_low), "clip_ratio_high": float(trainer.epsilon_high),
            "clip_ratio_c": None, "loss_agg_mode": TRL_LOSS_AGG_MODES[trainer.loss_type],
            "loss_scale_factor": float(trainer.max_completion_length), "use_kl_loss": beta > 0,
            "kl_loss_coef": beta, "kl_loss_type": "k3"}


def dump_trl_step(inputs: Mapping[str, Any], per_token_logps, path: str, *, entropy=None,
                  metrics: Optional[Mapping[str, float]] = None, trainer=None) -> str:
    """Write one TRL ``GRPOTrainer`` loss step to ``path``.

    Args:
      inputs: the ``inputs`` dict of ``GRPOTrainer._compute_loss``: ``completion_mask`` ``[B, T]``,
        ``advantages`` ``[B]``, optionally ``old_per_token_logps`` (absent when TRL reuses the current
        log-probs: then ``old = per_token_logps``), ``ref_per_token_logps``.
      per_token_logps: ``[B, T]`` current log-probs. entropy: ``[B, T]`` or None (TRL's ``entropies``).
      path: output ``.safetensors``. metrics: reported scalars (``loss``, ...).
      trainer: the ``GRPOTrainer`` (``self`` in ``_compute_loss``); its loss settings
        (:func:`trl_loss_settings`) go to the file's metadata for ``check``. None: no settings.
    Returns: ``path``. Raises: KeyError naming a missing input; ValueError as :func:`trl_loss_settings`.
    Source: TRL 1.16 ``grpo_trainer.py``.
    Dtypes: floating tensors are written as float32.
    """
    for need in ("completion_mask", "advantages"):
        if need not in inputs:
            raise KeyError(f"TRL inputs have no {need!r} (keys: {sorted(inputs)})")
    lp = _np(per_token_logps)
    old = inputs.get("old_per_token_logps")
    out = {"old_log_probs": lp.copy() if old is None else _np(old), "log_probs": lp,
           "advantages": _np(inputs["advantages"]), "response_mask": _np(inputs["completion_mask"]).astype(np.float32)}
    if inputs.get("ref_per_token_logps") is not None:
        out["ref_log_probs"] = _np(inputs["ref_per_token_logps"])
    if entropy is not None:
        out["entropy"] = _np(entropy)
    return _save(out, metrics, path, None if trainer is None else trl_loss_settings(trainer))
