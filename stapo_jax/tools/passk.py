"""Sample-based accuracy estimators for benchmark evaluation: avg@n and unbiased pass@k.

* ``avg@n`` (stapo_spec §8): the mean over problems of the fraction of a problem's ``n`` samples that are
  correct, in percent.
* ``pass@k`` (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): with ``n``
  samples of which ``c`` are correct, the unbiased estimate of "at least one of k samples is correct" is
  ``1 - C(n-c, k) / C(n, k)``. Binomials overflow float64 for n ~ 1000, so it is computed as the product
  ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (the numerically stable form of the paper's Figure 3 code).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["PassKError", "pass_at_k", "mean_pass_at_k", "avg_at_n", "default_ks"]


class PassKError(ValueError):
    """Invalid sample counts (``n``, ``c``, ``k``), named in the message."""


def _check(n: int, c: int, k: int) -> None:
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise PassKError(f"pass@k: {name}={v!r} must be an int")
    if n < 1:
        raise PassKError(f"pass@k: n={n} samples must be >= 1")
    if not 0 <= c <= n:
        raise PassKError(f"pass@k: c={c} correct samples must lie in [0, n={n}]")
    if not 1 <= k <= n:
        raise PassKError(f"pass@k: k={k} must lie in [1, n={n}] (cannot estimate pass@k from fewer samples)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem, ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, eq. 1).

    Args:
      n: samples drawn for the problem (int >= 1).
      c: correct samples among them (int, 0 <= c <= n).
      k: the budget (int, 1 <= k <= n).
    Returns:
      A probability in [0, 1] (Python float). Exactly 1.0 when ``n - c < k`` (every k-subset holds a correct
      sample) and exactly 0.0 when ``c == 0``. ``pass_at_k(n, c, 1) == c / n``.
    Raises:
      PassKError: a non-int argument or one out of range.
    """
    _check(n, c, k)
    if n - c < k:
        return 1.0
    # C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): a product of c factors in (0, 1], no overflow.
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def mean_pass_at_k(n: int | Sequence[int], correct: Iterable[int], k: int) -> float:
    """Mean of :func:`pass_at_k` over problems, in percent.

    Args:
      n: samples per problem: one int for all problems, or one per problem.
      correct: correct-sample count per problem (length P >= 1).
      k: the budget (1 <= k <= every problem's n).
    Returns:
      ``100 * mean_q pass@k(n_q, c_q, k)`` as a float.
    Raises:
      PassKError: no problems, mismatched lengths, or an invalid count (see :func:`pass_at_k`).

    Source: the unbiased pass@k estimator of Chen et al. 2021 (Codex paper, arXiv:2107.03374), averaged over
    problems (the pass@k columns of ``stapo-jax eval``).
    """
    cs = [int(c) for c in correct]
    if not cs:
        raise PassKError("pass@k: no problems to average over")
    ns = [int(n)] * len(cs) if np.ndim(n) == 0 else [int(x) for x in n]
    if len(ns) != len(cs):
        raise PassKError(f"pass@k: {len(ns)} sample counts for {len(cs)} problems")
    return 100.0 * float(np.mean([pass_at_k(nq, cq, k) for nq, cq in zip(ns, cs)]))


def avg_at_n(scores: np.ndarray | Sequence[Sequence[float]]) -> float:
    """avg@n in percent (stapo_spec §8): ``100 * mean_q mean_j score[q, j]``.

    Args:
      scores: [P, n] array of per-sample correctness in [0, 1] (float or bool); P problems, n samples each.
    Returns:
      The percentage as a float (equal to ``mean_pass_at_k(n, row sums, 1)`` for 0/1 scores).
    Raises:
      PassKError: not a non-empty 2-D array, or a value outside [0, 1] or non-finite.
    """
    a = np.asarray(scores, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise PassKError(f"avg@n: scores must be a non-empty [problems, samples] array, got shape {a.shape}")
    if not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 1:
        raise PassKError("avg@n: scores must be finite and lie in [0, 1]")
    return 100.0 * float(a.mean())


def default_ks(n: int) -> list[int]:
    """The pass@k budgets reported for ``n`` samples: powers of two up to ``n``, plus ``n`` itself.

    >>> default_ks(32), default_ks(4), default_ks(6)
    ([1, 2, 4, 8, 16, 32], [1, 2, 4], [1, 2, 4, 6])

    Int in, list of int out.

    Raises:
      PassKError: ``n`` < 1.

    Source: the power-of-two budgets of the pass@k convention (Chen et al. 2021, arXiv:2107.03374).
    """
    if n < 1:
        raise PassKError(f"default_ks: n={n} must be >= 1")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks
