"""The sort-based top-k/top-p truncation that ``stapo_jax.rollout.sampling`` used before its bisection,
re-created verbatim as the reference of tests/rollout/test_sampling.py and the "before" side of
bench/bench_weight_sync.py (``--sections sampler``). Used only by tests and benches.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sort_truncate_logits(scaled_logits: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Top-k then top-p truncation by sorting: ``jax.lax.top_k`` values (top-k on) or a full descending sort
    of the row (top-p alone), the top-p softmax over those sorted candidates, ``cumsum`` for the mass of the
    strictly more likely ones, then every logit ``>=`` the last kept value survives (ties kept).

    Args:
      scaled_logits: ``[B, V]`` float32, logits already divided by the temperature.
      top_k: >= 0 (static); 0 = off; values >= V keep everything.
      top_p: in (0, 1] (static); 1.0 = off.
    Returns:
      ``[B, V]`` float32 with the removed entries ``-inf``.
    Raises:
      nothing (the caller validates top_k / top_p).
    Source: ``stapo_jax/rollout/sampling.py`` before the bisection (transformers ``TopKLogitsWarper`` /
    ``TopPLogitsWarper`` with thresholds kept). With top-k on, its top-p softmax is over exactly ``k``
    candidates, so entries tied with the k-th value beyond the k-th place are left out of the normalisation;
    ``sort_truncate_logits(sort_truncate_logits(x, k), 0, p)`` puts them in (what ``TopPLogitsWarper`` sees).
    """
    v = scaled_logits.shape[-1]
    use_k = 0 < top_k < v
    if not use_k and top_p >= 1.0:
        return scaled_logits
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
    return jnp.where(scaled_logits >= threshold[:, None], scaled_logits, -jnp.inf)
