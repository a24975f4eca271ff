"""math-verify grading of one response against a gold answer (``reward.kind: math_verify_01``).

Runs inside a worker process of :class:`stapo_jax.rewards.VerifierPool` (math-verify's own timeouts use
``signal.alarm``, which only works in a process's main thread; the pool runs tasks in the worker's main
thread and enforces the per-item timeout itself by killing the worker, so math-verify's internal timeouts are
switched off here). Argument order is gold first: ``verify(gold, prediction)`` (conventions.md §8).

Extraction follows verl's ``utils/reward_score/math_verify.py``: the gold answer is wrapped as
``\\boxed{gold}`` and parsed as LaTeX; the prediction is parsed from the whole response with expression and
LaTeX extraction (a ``\\boxed{}`` answer has the highest priority). Model output is only parsed, never
evaluated as Python.
"""
from __future__ import annotations

import logging

from stapo_jax.rewards.registry import register_reward


def _configs():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return (LatexExtractionConfig(),), (ExprExtractionConfig(), LatexExtractionConfig())


def init_worker() -> None:
    """Pool-worker initializer: import math-verify once and silence its "timeout disabled" warning.

    Returns None; raises ImportError if math-verify is not installed. Source: math-verify's logger
    name (``math_verify``).
    """
    import math_verify  # noqa: F401

    logging.getLogger("math_verify").setLevel(logging.ERROR)


def parse_gold(gold: str) -> list:
    """math-verify parse of a gold answer string (wrapped in ``\\boxed{}``); [] if unparseable.

    Str in, math-verify's list of parsed answers (sympy expr, str) out. Never raises on a str
    (math-verify's ``raise_on_error=False`` default: an unparseable gold gives []). Source: verl
    ``utils/reward_score/math_verify.py`` (gold wrapped as ``\\boxed{gold}``).
    """
    from math_verify import parse

    gold_cfg, _ = _configs()
    return parse("\\boxed{" + gold + "}", extraction_config=gold_cfg, parsing_timeout=None)


@register_reward("math_verify_01", pooled=True)
def verify_one(response: str, gold: str) -> bool:
    """True iff math-verify judges the answer in ``response`` equal to ``gold``.

    Args:
      response: model output text (any length; the whole text is searched, last ``\\boxed{}`` first).
      gold: the reference answer (e.g. ``"\\frac{14}{3}"``, ``"18"``).
    Returns:
      bool. An unparseable gold or prediction gives False (math-verify's ``raise_on_error=False``).
    Raises:
      TypeError: a non-str argument.
    """
    if not isinstance(response, str) or not isinstance(gold, str):
        raise TypeError(f"response and gold must be str, got {type(response).__name__}, {type(gold).__name__}")
    from math_verify import parse, verify

    _, pred_cfg = _configs()
    gold_parsed = parse_gold(gold)
    if not gold_parsed:
        return False
    pred_parsed = parse(response, extraction_config=pred_cfg, parsing_timeout=None)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
