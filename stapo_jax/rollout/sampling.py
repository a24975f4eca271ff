"""Next-token sampling for the rollout engine: temperature, top-k, top-p, greedy. Pure and jittable.

The returned log-prob of each chosen token is the **trainer's** quantity: the full-vocabulary,
temperature-scaled log-softmax, computed before any top-k/top-p truncation (conventions.md §5; the Tunix
vanilla sampler does the same). It is computed by :func:`stapo_jax.algo.logprobs.logits_to_log_probs`, the very
function the trainer uses (its body :func:`~stapo_jax.algo.logprobs.scaled_log_probs`), so the two share one
definition. Sampling and the log-prob share one temperature-scaled copy of the logits: the draw is Gumbel-max
over its truncation, ``argmax(gumbel(key, [V]) + truncated)``, exactly what ``jax.random.categorical`` computes
(same noise, same sum, so the same tokens for the same keys), and the log-prob is taken from the untruncated
scaled logits; greedy decoding takes the row maximum from its argmax, and top-k from its first value, instead
of a second max pass over the vocabulary, giving the same float (tests/test_sampling.py).

Truncation follows transformers' logits processors in the order ``generate`` applies them:
temperature -> top-k (``TopKLogitsWarper``: keep logits >= the k-th largest, ties kept) -> top-p
(``TopPLogitsWarper``: over the softmax of what top-k kept, drop the tokens whose ascending cumulative
probability is <= 1 - top_p, always keeping the most likely token). The token is then drawn from the
softmax of the truncated, temperature-scaled logits with ``jax.random.categorical`` (Gumbel-max).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from stapo_jax.algo.logprobs import scaled_log_probs

__all__ = ["SamplingParams", "SamplingParamsError", "gumbel_noise", "truncate_logits", "sample_tokens"]


class SamplingParamsError(ValueError):
    """An invalid sampling setting (names the field)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings (hashable: a static argument of jitted steps).

    Attributes:
      temperature: > 0. Logits are divided by it, for sampling *and* for the reported log-probs
        (the trainer must use the same value; verl/TRL divide logits by the rollout temperature).
      top_p: in (0, 1]; 1.0 disables nucleus truncation (the STAPO training setting).
      top_k: >= 0; 0 disables top-k truncation.
      greedy: if True, take the argmax of the logits (temperature, top-p and top-k do not change the choice);
        the reported log-prob is still the temperature-scaled full-vocabulary one.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise SamplingParamsError(f"SamplingParams.temperature must be a finite float > 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise SamplingParamsError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SamplingParamsError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {k!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def truncates(self) -> bool:
        """True when top-k or top-p removes part of the vocabulary."""
        return self.top_k > 0 or self.top_p < 1.0


def truncate_logits(scaled_logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Set the logits that top-k, then top-p, remove to ``-inf`` (transformers warper semantics).

    Args:
      scaled_logits: ``[B, V]`` float32, logits already divided by the temperature.
      top_k: >= 0 (static); 0 = off. Values >= V keep everything.
      top_p: in (0, 1] (static); 1.0 = off.
    Returns:
      ``[B, V]`` float32; removed entries are ``-inf``. At least one entry per row stays finite.
    Raises:
      SamplingParamsError: top_k < 0 or top_p outside (0, 1].
    Source: transformers ``TopKLogitsWarper`` / ``TopPLogitsWarper`` (``generation/logits_process.py``).
    """
    return _truncate(scaled_logits, top_k, top_p)[0]


def _truncate(scaled_logits, top_k, top_p):
    """:func:`truncate_logits` and the exact row maximum when truncation computed it (else None)."""
    if top_k < 0:
        raise SamplingParamsError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise SamplingParamsError(f"top_p must be in (0, 1], got {top_p}")
    v = scaled_logits.shape[-1]
    use_k = 0 < top_k < v
    if not use_k and top_p >= 1.0:
        return scaled_logits, None
    # Descending candidate values: only the top-k when top-k is on (no full-vocabulary sort).
    vals = jax.lax.top_k(scaled_logits, top_k)[0] if use_k else -jnp.sort(-scaled_logits, axis=-1)
    threshold = vals[:, -1] if use_k else jnp.full(vals.shape[:1], -jnp.inf, vals.dtype)
    if top_p < 1.0:
        probs = jax.nn.softmax(vals, axis=-1)
        cum_before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely candidates
        keep = cum_before < top_p
        keep = keep.at[:, 0].set(True)
        n_keep = jnp.sum(keep, axis=-1)
        p_threshold = jnp.take_along_axis(vals, (n_keep - 1)[:, None], axis=-1)[:, 0]
        threshold = jnp.maximum(threshold, p_threshold)
    return jnp.where(scaled_logits >= threshold[:, None], scaled_logits, -jnp.inf), vals[:, 0]


def gumbel_noise(keys: jax.Array, vocab_size: int) -> jax.Array:
    """The Gumbel noise ``jax.random.categorical(key, logits)`` adds to a ``[V]`` row of float32 logits,
    for each of the ``[B]`` typed keys: ``[B, V]`` float32 (``jax.random.gumbel(key, (V,), float32)``, the
    default ``mode``). Never raises for a [B] key array. Source: ``jax.random.categorical`` (Gumbel-max)."""
    return jax.vmap(lambda k: jax.random.gumbel(k, (vocab_size,), jnp.float32))(keys)


def sample_tokens(logits: jax.Array, keys: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row and return it with its full-vocabulary, temperature-scaled log-prob.

    Args:
      logits: ``[B, V]`` float (cast to float32), raw (un-scaled) next-token logits.
      keys: ``[B]`` typed PRNG key array (``jax.random.key``), one key per row; rows are independent, so a
        row's draw depends only on its own key (not on batch composition). Ignored when ``params.greedy``.
      params: :class:`SamplingParams` (static under ``jax.jit``).
    Returns:
      ``(tokens, log_probs)``: ``[B]`` int32 token ids and ``[B]`` float32
      ``log softmax(logits / temperature)[token]`` in nats, before truncation (conventions.md §5). The tokens
      equal ``jax.vmap(jax.random.categorical)(keys, truncate_logits(logits / temperature, ...))`` and the
      log-probs ``logits_to_log_probs(logits, tokens, temperature)`` (tests/test_sampling.py).
    Raises:
      ValueError: ``logits`` is not rank 2 or ``keys`` does not have B entries.
    Source: conventions.md §5; transformers logits warpers (see :func:`truncate_logits`); Tunix sampler;
    ``jax.random.categorical`` (Gumbel-max).
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    logits = logits.astype(jnp.float32)
    z = logits / params.temperature  # shared by the draw and the log-prob
    if params.greedy:
        # z = logits / T is monotone in the logits, so z[argmax] is the row maximum the log-sum-exp needs.
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        row_max = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]
        return tokens, scaled_log_probs(z, tokens, row_max)
    if keys.shape != logits.shape[:1]:
        raise ValueError(f"keys must have shape [B] = {logits.shape[:1]}, got {tuple(keys.shape)}")
    truncated, row_max = _truncate(z, params.top_k, params.top_p)
    tokens = jnp.argmax(gumbel_noise(keys, z.shape[-1]) + truncated, axis=-1).astype(jnp.int32)
    return tokens, scaled_log_probs(z, tokens, row_max)
