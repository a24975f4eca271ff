"""Next-token sampling for the rollout engine: temperature, top-k, top-p, greedy. Pure and jittable.

The returned log-prob of each chosen token is the **trainer's** quantity: the full-vocabulary,
temperature-scaled log-softmax, computed before any top-k/top-p truncation (conventions.md §5; the Tunix
vanilla sampler does the same). It is computed by :func:`stapo_jax.algo.logprobs.logits_to_log_probs`, the very
function the trainer uses (its body :func:`~stapo_jax.algo.logprobs.scaled_log_probs`), so the two share one
definition. Sampling and the log-prob share one temperature-scaled copy of the logits: the draw is Gumbel-max
over its truncation, ``argmax(gumbel(key, [V]) + truncated)``, exactly what ``jax.random.categorical`` computes
(same noise, same sum, so the same tokens for the same keys), and the log-prob is taken from the untruncated
scaled logits; greedy decoding takes the row maximum from its argmax, and truncation from the maximum its
bisection needs anyway, instead of a second max pass over the vocabulary, giving the same float
(tests/rollout/test_sampling.py).

Truncation follows transformers' logits processors in the order ``generate`` applies them:
temperature -> top-k (``TopKLogitsWarper``: keep logits >= the k-th largest, ties kept) -> top-p
(``TopPLogitsWarper``: over the softmax of what top-k kept, drop the tokens whose ascending cumulative
probability is <= 1 - top_p, always keeping the most likely token; ties of the last kept value kept), with
both thresholds found by bisection over the float order, not by sorting the vocabulary (see
:func:`truncate_logits`). The token is then drawn from the softmax of the truncated, temperature-scaled logits with ``jax.random.categorical`` (Gumbel-max).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from stapo_jax.algo.logprobs import scaled_log_probs

__all__ = ["SamplingParams", "SamplingParamsError", "first_argmax", "gumbel_noise", "truncate_logits", "sample_tokens"]


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
    """Set the logits that top-k, then top-p, remove to ``-inf`` (transformers warper semantics, ties kept).

    Kept: with ``t_k`` the k-th largest value (counted with repeats; the row minimum when top-k is off), the
    entries ``>= t_p``, where ``t_p`` is the smallest value ``>= t_k`` present in the row whose entries ``<=`` it
    hold probability mass ``> 1 - top_p``, or the row maximum when none does (the mass is the softmax over the
    entries ``>= t_k``, what ``TopKLogitsWarper`` kept). This is ``TopPLogitsWarper``'s rule (drop a token when
    the ascending cumulative probability up to it is ``<= 1 - top_p``, always keep the most likely), with every
    entry tied with the last kept value kept too, so that the result does not depend on a sort's order among
    equal logits (transformers may keep only some of them).

    Both thresholds are found by bisection over the float32 order instead of a sort: each of 32 steps (a fixed count)
    is one masked ``[B, V]`` count (top-k) or probability sum (top-p) over an order-preserving uint32 key of the
    logits. ``t_k`` is exact. ``t_p`` is exact up to float32 rounding of that sum: like transformers it sums the
    small tail (mass ``<= 1 - top_p`` at the boundary), so for top_p near 1 the keep-masks equal a float64
    reference and transformers' where the sort-based cumulative sum of the head mass (this module before the
    bisection) dropped or kept one boundary token wrongly; a row whose boundary mass equals ``1 - top_p`` to
    within float32 rounding (~1e-7 relative) may still land on either side (tests/rollout/test_sampling.py measures
    it). The sort-based top-p normalised over exactly ``k`` top-k candidates; here, as in transformers, every
    entry tied with the k-th value is in the softmax.

    Args:
      scaled_logits: ``[B, V]`` float32 (no NaN), logits already divided by the temperature; ``-inf`` allowed.
      top_k: >= 0 (static); 0 = off. Values >= V keep everything.
      top_p: in (0, 1] (static); 1.0 = off.
    Returns:
      ``[B, V]`` float32; removed entries are ``-inf``, kept ones unchanged. At least one entry per row is kept
      (finite when the row has a finite entry).
    Raises:
      SamplingParamsError: top_k < 0 or top_p outside (0, 1].
    Source: transformers ``TopKLogitsWarper`` / ``TopPLogitsWarper`` (``generation/logits_process.py``).
    """
    return _truncate(scaled_logits, top_k, top_p)[0]


_SIGN = 0x80000000
_STEPS = 32  # bisection steps that shrink any uint32 interval to one key


def _order_keys(x):
    """uint32 keys in the float order of ``x`` (float32, no NaN); -0.0 and +0.0 get the same key."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    sign = jnp.uint32(_SIGN)
    return jnp.where(bits >= sign, ~bits, bits | sign)


def _bisect(pred, lo, hi, largest: bool):
    """Per row, the largest (``largest``) or smallest key in ``[lo, hi]`` (``[B]`` uint32) where the monotone
    ``pred`` (``[B]`` uint32 -> ``[B]`` bool) holds; it must hold at ``lo`` (largest) or ``hi`` (smallest)."""

    def body(carry):
        lo, hi, step = carry
        d = hi - lo
        mid = lo + (d >> 1) + (d & 1 if largest else jnp.uint32(0))
        ok = pred(mid)
        if largest:
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1), step + 1
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi), step + 1

    # A fixed trip count, not ``while any(lo < hi)``: a loop whose count depends on data makes XLA:GPU copy the
    # loop predicate to the host on every iteration (32 round trips per bisection and decode step); once
    # ``lo == hi`` a further step leaves both unchanged, so the result is the same.
    lo, hi, _ = jax.lax.fori_loop(0, _STEPS, lambda _, c: body(c), (lo, hi, 0))
    return lo if largest else hi


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
    keys = _order_keys(scaled_logits)
    row_max = jnp.max(scaled_logits, axis=-1)
    hi = _order_keys(row_max)
    threshold = jnp.min(keys, axis=-1)
    if use_k:  # t_k: the largest key with at least k entries >= it
        threshold = _bisect(lambda u: jnp.sum(keys >= u[:, None], axis=-1, dtype=jnp.int32) >= top_k,
                            threshold, hi, largest=True)
    if top_p < 1.0:  # t_p: the smallest key >= t_k whose entries <= it hold mass > 1 - top_p
        probs = jax.nn.softmax(jnp.where(keys >= threshold[:, None], scaled_logits, -jnp.inf), axis=-1)
        threshold = _bisect(lambda u: jnp.sum(jnp.where(keys <= u[:, None], probs, 0.0), axis=-1) > 1.0 - top_p,
                            threshold, hi, largest=False)
    return jnp.where(keys >= threshold[:, None], scaled_logits, -jnp.inf), row_max


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` as int32 (the first index of the row maximum, or of the row's first NaN), from
    a max and a min over the row instead of XLA's two-operand (value, index) reduction: 3.2 vs 7.7 ms over
    ``[32, 151,936]`` float32 on a 2-core Intel Xeon (the greedy pick and the Gumbel-max draw of every decode
    step). Shapes: ``[..., V]`` float -> ``[...]`` int32. Never raises (traced). Source: ``jnp.argmax``'s
    tie and NaN rule (tests/rollout/test_sampling.py checks equality on ties, NaN and all ``-inf`` rows)."""
    row_max = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    hit = (x == row_max) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1).astype(jnp.int32)


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
      log-probs ``logits_to_log_probs(logits, tokens, temperature)`` (tests/rollout/test_sampling.py).
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
        tokens = first_argmax(logits)
        row_max = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]
        return tokens, scaled_log_probs(z, tokens, row_max)
    if keys.shape != logits.shape[:1]:
        raise ValueError(f"keys must have shape [B] = {logits.shape[:1]}, got {tuple(keys.shape)}")
    truncated, row_max = _truncate(z, params.top_k, params.top_p)
    tokens = first_argmax(gumbel_noise(keys, z.shape[-1]) + truncated)
    return tokens, scaled_log_probs(z, tokens, row_max)
