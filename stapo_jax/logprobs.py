"""Token log-probabilities and entropies: one definition for the sampler and the trainer.

Every function here computes, in float32 (or float64 when given float64 inputs and x64 is on),

    z       = logits / temperature                      (full vocabulary, no top-p/top-k truncation)
    log_p   = z[y] - logsumexp(z)                        (nats)
    entropy = logsumexp(z) - sum_v softmax(z)_v * z_v    (nats; verl ``entropy_from_logits``)

which is the trainer definition of conventions.md §5 (verl ``logprobs_from_logits`` /
``entropy_from_logits``; Tunix vanilla sampler). The rollout engine imports ``logits_to_log_probs`` so the
sampler and the trainer share it, which makes the first ratio of an on-policy update exactly 1.

``chunked_log_probs_and_entropy`` computes the same quantities from hidden states and the LM head without
materialising the ``[B, T, V]`` logits: a ``lax.scan`` over sequence chunks with ``jax.checkpoint`` (Tunix
``compute_chunked_logps``) and, optionally, a streaming log-sum-exp over vocabulary chunks (EasyDeL
``_logprob_utils.py``) with entropy = logZ - E_p[z].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "logits_to_log_probs",
    "logits_to_log_probs_and_entropy",
    "chunked_log_probs_and_entropy",
]


def _check_temperature(temperature) -> None:
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _acc_dtype(x: jax.Array):
    """float32 accumulation unless the caller works in float64 (parity tests)."""
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _check_token_ids(logits_shape, token_ids: jax.Array, name: str = "logits") -> None:
    if tuple(token_ids.shape) != tuple(logits_shape[:-1]):
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} must equal {name}.shape[:-1] = {tuple(logits_shape[:-1])}"
        )
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
    _check_temperature(temperature)
    _check_token_ids(logits.shape, token_ids)
    z = logits.astype(_acc_dtype(logits)) / temperature
    log_z = jax.nn.logsumexp(z, axis=-1)
    z_y = jnp.take_along_axis(z, token_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    probs = jax.nn.softmax(z, axis=-1)
    entropy = log_z - jnp.sum(probs * z, axis=-1)
    return z_y - log_z, entropy


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
    _check_temperature(temperature)
    _check_token_ids(logits.shape, token_ids)
    z = logits.astype(_acc_dtype(logits)) / temperature
    z_y = jnp.take_along_axis(z, token_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return z_y - jax.nn.logsumexp(z, axis=-1)


def _chunk_stats_full_vocab(h, w, ids, temperature, acc):
    """One sequence chunk, whole vocabulary at once. h [B,c,D], w [D,V], ids [B,c] -> (log_p, H) [B,c]."""
    z = jnp.einsum("bcd,dv->bcv", h, w, preferred_element_type=acc).astype(acc) / temperature
    log_z = jax.nn.logsumexp(z, axis=-1)
    z_y = jnp.take_along_axis(z, ids[..., None], axis=-1)[..., 0]
    probs = jax.nn.softmax(z, axis=-1)
    ez = jnp.sum(probs * z, axis=-1)
    return z_y - log_z, log_z - ez, jnp.sum(probs * probs, axis=-1)


def _chunk_stats_streaming(h, w, ids, temperature, acc, vocab_chunk):
    """One sequence chunk, streaming log-sum-exp over vocabulary chunks of width ``vocab_chunk``.

    Carries (m, s, t, q, z_y): running max m, s = sum exp(z - m), t = sum exp(z - m) * z,
    q = sum exp(2 (z - m)), and the logit of the target token. At the end logZ = m + log s, E_p[z] = t / s,
    entropy = logZ - E_p[z], collision probability sum_v p_v^2 = q / s^2.
    """
    d, v = w.shape
    n_chunks = -(-v // vocab_chunk)
    v_pad = n_chunks * vocab_chunk
    if v_pad != v:
        w = jnp.pad(w, ((0, 0), (0, v_pad - v)))
    w_chunks = w.reshape(d, n_chunks, vocab_chunk).transpose(1, 0, 2)  # [n, D, vc]
    b, c = ids.shape
    neg = jnp.asarray(-1e30 if acc == jnp.float32 else -1e300, acc)

    @jax.checkpoint
    def body(carry, xs):
        m, s, t, q, z_y = carry
        w_c, start = xs
        z = jnp.einsum("bcd,dv->bcv", h, w_c, preferred_element_type=acc).astype(acc) / temperature
        col = start + jnp.arange(vocab_chunk)
        valid = col < v
        z = jnp.where(valid, z, neg)
        m_new = jnp.maximum(m, jnp.max(z, axis=-1))
        scale = jnp.exp(m - m_new)
        e = jnp.where(valid, jnp.exp(z - m_new[..., None]), 0.0)
        s = s * scale + jnp.sum(e, axis=-1)
        t = t * scale + jnp.sum(e * jnp.where(valid, z, 0.0), axis=-1)
        q = q * scale * scale + jnp.sum(e * e, axis=-1)
        local = ids - start
        in_chunk = (local >= 0) & (local < vocab_chunk)
        picked = jnp.take_along_axis(z, jnp.clip(local, 0, vocab_chunk - 1)[..., None], axis=-1)[..., 0]
        z_y = jnp.where(in_chunk, picked, z_y)
        return (m_new, s, t, q, z_y), None

    init = (
        jnp.full((b, c), neg, acc),
        jnp.zeros((b, c), acc),
        jnp.zeros((b, c), acc),
        jnp.zeros((b, c), acc),
        jnp.zeros((b, c), acc),
    )
    starts = jnp.arange(n_chunks, dtype=jnp.int32) * vocab_chunk
    (m, s, t, q, z_y), _ = jax.lax.scan(body, init, (w_chunks, starts))
    log_z = m + jnp.log(s)
    return z_y - log_z, log_z - t / s, q / (s * s)


def chunked_log_probs_and_entropy(
    hidden: jax.Array,
    lm_head_weight: jax.Array,
    token_ids: jax.Array,
    *,
    temperature: float = 1.0,
    seq_chunk: int = 512,
    vocab_chunk: int | None = None,
    with_collision: bool = False,
) -> tuple[jax.Array, ...]:
    """Per-token log-probability and entropy from hidden states, never materialising ``[B, T, V]`` logits.

    ``logits[b, t] = hidden[b, t] @ lm_head_weight`` (accumulated in float32), divided by ``temperature``;
    ``log_probs[b, t] = log softmax(logits[b, t])[token_ids[b, t]]`` and
    ``entropy[b, t] = logsumexp(logits[b, t]) - E_softmax[logits[b, t]]``, identical (to float rounding)
    to ``logits_to_log_probs_and_entropy(hidden @ lm_head_weight, token_ids, temperature)``.

    The sequence is processed in chunks of ``seq_chunk`` positions by a ``lax.scan`` whose body is
    rematerialised (``jax.checkpoint``), so the backward pass holds one chunk's logits ``[B, seq_chunk, V]``
    at a time. With ``vocab_chunk`` set, each sequence chunk is further streamed over vocabulary slices of
    that width (online log-sum-exp), so the largest logits buffer is ``[B, seq_chunk, vocab_chunk]``.
    Gradients flow to ``hidden`` and ``lm_head_weight`` through both paths.

    Args:
      hidden: ``[B, T, D]`` float (bf16/f32/f64), the model's final-norm hidden states at the positions that
        predict ``token_ids`` (i.e. already shifted by the caller).
      lm_head_weight: ``[D, V]`` float (``embedding.T`` for tied models).
      token_ids: ``[B, T]`` integer ids of the tokens whose probability is wanted.
      temperature: positive float, the sampling temperature.
      seq_chunk: positive int; T need not be a multiple (the tail is zero-padded and dropped).
      vocab_chunk: positive int or None (None: one matmul over the whole vocabulary per sequence chunk).
      with_collision: also return the collision probability ``C = sum_v softmax(z)_v^2`` ``[B, T]`` (for the
        Lemma A.1 gradient-norm diagnostic, ``stapo_jax.diagnostics``).

    Returns:
      ``(log_probs, entropy)`` (or ``(log_probs, entropy, collision)``), each ``[B, T]`` float32 (float64 for
      float64 inputs); log-probs and entropy in nats.

    Raises:
      ValueError: on rank/shape mismatches (naming the argument), non-integer ``token_ids``, or
        non-positive ``seq_chunk`` / ``vocab_chunk`` / ``temperature``.

    Source: conventions.md §5 (EasyDeL streaming log-sum-exp; Tunix ``compute_chunked_logps``); the entropy
    identity is verl ``entropy_from_logits``.
    """
    _check_temperature(temperature)
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, D], got shape {tuple(hidden.shape)}")
    if lm_head_weight.ndim != 2 or lm_head_weight.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [D, V] with D = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got shape {tuple(lm_head_weight.shape)}"
        )
    if tuple(token_ids.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"token_ids shape {tuple(token_ids.shape)} must equal hidden.shape[:2] = {hidden.shape[:2]}")
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
        raise ValueError(f"token_ids must be an integer array, got dtype {token_ids.dtype}")
    if int(seq_chunk) <= 0:
        raise ValueError(f"seq_chunk must be > 0, got {seq_chunk}")
    if vocab_chunk is not None and int(vocab_chunk) <= 0:
        raise ValueError(f"vocab_chunk must be > 0 or None, got {vocab_chunk}")

    acc = jnp.float64 if (hidden.dtype == jnp.float64 or lm_head_weight.dtype == jnp.float64) else jnp.float32
    b, t, d = hidden.shape
    c = min(int(seq_chunk), t)
    n = -(-t // c)
    t_pad = n * c
    ids = token_ids.astype(jnp.int32)
    if t_pad != t:
        hidden = jnp.pad(hidden, ((0, 0), (0, t_pad - t), (0, 0)))
        ids = jnp.pad(ids, ((0, 0), (0, t_pad - t)))
    h_chunks = hidden.reshape(b, n, c, d).transpose(1, 0, 2, 3)  # [n, B, c, D]
    id_chunks = ids.reshape(b, n, c).transpose(1, 0, 2)  # [n, B, c]

    if vocab_chunk is None or int(vocab_chunk) >= lm_head_weight.shape[1]:

        def stats(h, i):
            return _chunk_stats_full_vocab(h, lm_head_weight, i, temperature, acc)

    else:
        vc = int(vocab_chunk)

        def stats(h, i):
            return _chunk_stats_streaming(h, lm_head_weight, i, temperature, acc, vc)

    @jax.checkpoint
    def body(_, xs):
        h, i = xs
        return None, stats(h, i)

    _, outs = jax.lax.scan(body, None, (h_chunks, id_chunks))
    outs = tuple(o.transpose(1, 0, 2).reshape(b, t_pad)[:, :t] for o in outs)
    return outs if with_collision else outs[:2]
