"""Token log-probabilities and entropies: one definition for the sampler and the trainer.

Every function here computes, in float32 (or float64 when given float64 inputs and x64 is on),

    z       = logits / temperature                      (full vocabulary, no top-p/top-k truncation)
    log_p   = z[y] - logsumexp(z)                        (nats)
    entropy = logsumexp(z) - sum_v softmax(z)_v * z_v    (nats; verl ``entropy_from_logits``)

which is the trainer definition of conventions.md §5 (verl ``logprobs_from_logits`` /
``entropy_from_logits``; Tunix vanilla sampler). The rollout engine imports ``logits_to_log_probs`` so the
sampler and the trainer share it, which makes the first ratio of an on-policy update exactly 1.

:func:`stapo_jax.algo.chunked_logprobs.chunked_log_probs_and_entropy` computes the same quantities from hidden
states and the LM head without ``[B, T, V]`` logits (the trainer's path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["logits_to_log_probs", "logits_to_log_probs_and_entropy", "scaled_log_probs"]


def check_temperature(temperature) -> None:
    """Raise ValueError ``"temperature must be > 0, got ..."`` for a Python int / float ``temperature`` <= 0 (a
    traced array is not checked). Source: HF transformers ``generate`` (a positive sampling temperature)."""
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def accumulation_dtype(*xs: jax.Array):
    """The dtype the log-prob functions accumulate in for the arrays ``xs`` (any shapes): ``jnp.float64`` when
    one of them is float64 (the float64 parity tests, with x64 on), else ``jnp.float32``. Never raises.
    Source: conventions.md §5 (log-probs and entropies in float32)."""
    return jnp.float64 if any(x.dtype == jnp.float64 for x in xs) else jnp.float32


def _check_token_ids(logits_shape, token_ids: jax.Array, name: str = "logits") -> None:
    if tuple(token_ids.shape) != tuple(logits_shape[:-1]):
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} must equal {name}.shape[:-1] = "
                         f"{tuple(logits_shape[:-1])}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be an integer array, got dtype {token_ids.dtype}")


def logits_to_log_probs_and_entropy(
    logits: jax.Array, token_ids: jax.Array, temperature: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """Log-probability of ``token_ids`` and the Shannon entropy of the full-vocabulary softmax.

    Args:
      logits: ``[..., V]`` any float dtype (cast to float32; float64 stays float64).
      token_ids: ``[...]`` integer ids in ``[0, V)``; its shape equals ``logits.shape[:-1]``.
      temperature: positive float; logits are divided by it before the softmax, as the sampler does.

    Returns:
      ``(log_probs, entropy)``, both ``[...]`` float32 (float64 for float64 logits), in nats.

    Raises:
      ValueError: if ``token_ids`` does not match ``logits.shape[:-1]``, is not integer, or temperature <= 0.

    Source: conventions.md §5 (trainer definition), verl ``logprobs_from_logits`` and
    ``entropy_from_logits`` (``verl/utils/torch_functional.py``).
    """
    check_temperature(temperature)
    _check_token_ids(logits.shape, token_ids)
    z = logits.astype(accumulation_dtype(logits)) / temperature
    log_z, e_z, _ = log_z_and_mean_logit(z)
    z_y = jnp.take_along_axis(z, token_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return z_y - log_z, log_z - e_z


def log_z_and_mean_logit(z: jax.Array, with_mean: bool = True):
    """``(logsumexp(z), E_softmax(z)[z], softmax(z))`` over the last axis of ``z`` ``[..., V]`` (the softmax a
    lazy ``exp(z - max) / sum``); ``with_mean=False``: ``E_softmax(z)[z]`` is None and its pass is skipped.
    Shapes ``[...]``, ``[...]``, ``[..., V]`` in ``z``'s dtype (float32 / float64). Never raises (traced).
    Source: verl ``entropy_from_logits`` (``logsumexp(z) - sum softmax(z) * z``), ``jax.nn.logsumexp``.

    ``logsumexp`` is computed as ``jax.nn.logsumexp`` does (max, ``log(sum(exp(z - max))) + max``), so log-probs
    round like ``scaled_log_probs``; ``E[z]`` reuses its exponentials and takes the weighted sum as a dot product
    at full float32 precision: XLA:CPU ran a fused multiply-and-reduce over a 151,936-wide row about 4x slower
    (1.3 s vs 0.33 s for [511, 151,936] logits on a 2-core Xeon)."""
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(z - m)
    s = jnp.sum(e, axis=-1)
    log_z = jnp.log(s) + m[..., 0]
    if not with_mean:
        return log_z, None, e / s[..., None]
    weighted = jnp.einsum("...v,...v->...", e, z, precision=jax.lax.Precision.HIGHEST)
    return log_z, weighted / s, e / s[..., None]


def logits_to_log_probs(logits: jax.Array, token_ids: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Log-probability of ``token_ids`` under ``softmax(logits / temperature)`` over the full vocabulary.

    Args:
      logits: ``[..., V]`` any float dtype (computed in float32; float64 stays float64).
      token_ids: ``[...]`` integer ids in ``[0, V)``; shape ``logits.shape[:-1]``.
      temperature: positive float, the sampling temperature.

    Returns:
      ``log_probs`` ``[...]`` float32 (nats, <= 0).

    Raises:
      ValueError: shape/dtype mismatch of ``token_ids`` or temperature <= 0.

    Source: conventions.md §5; verl ``logprobs_from_logits``.
    """
    check_temperature(temperature)
    _check_token_ids(logits.shape, token_ids)
    return scaled_log_probs(logits.astype(accumulation_dtype(logits)) / temperature, token_ids)


def scaled_log_probs(z: jax.Array, token_ids: jax.Array, row_max: jax.Array | None = None) -> jax.Array:
    """``z[token_ids] - logsumexp(z)`` for logits ``z`` already divided by the temperature: the body of
    :func:`logits_to_log_probs`, for callers that hold ``z`` (the sampler shares it with its draw).

    Args:
      z: ``[..., V]`` float32 (or float64) temperature-scaled logits, full vocabulary (no truncation).
      token_ids: ``[...]`` integer ids in ``[0, V)``.
      row_max: optional ``[...]`` exact ``max(z, axis=-1)`` the caller already has (greedy's chosen logit,
        the sampler's row maximum); the max pass of the log-sum-exp is then skipped, and the result is the same
        float (``log(sum(exp(z - max))) + max``, the order of ``jax.nn.logsumexp``) for finite ``z``.
    Returns:
      ``[...]`` log-probs in nats (dtype of ``z``).
    Raises:
      ValueError: ``token_ids`` shape differs from ``z.shape[:-1]`` or is not integer.
    Source: conventions.md §5; verl ``logprobs_from_logits``.
    """
    _check_token_ids(z.shape, token_ids, "z")
    z_y = jnp.take_along_axis(z, token_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if row_max is None:
        return z_y - jax.nn.logsumexp(z, axis=-1)
    row_max = jax.lax.stop_gradient(row_max)
    return z_y - (jnp.log(jnp.sum(jnp.exp(z - row_max[..., None]), axis=-1)) + row_max)
