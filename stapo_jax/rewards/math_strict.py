"""Hardened math-verify grading (``reward.kind: math_verify_strict``; issue 13).

math-verify stays the engine: it parses both answers (``math_verify.parse`` with a ``LatexExtractionConfig``
for boxed and normalised answers, its anchored ``ExprExtractionConfig``/``LatexExtractionConfig`` for unboxed
ones) and decides every comparison that is not purely numeric (``math_verify.verify``, gold first, with
``strict=True``, so variables matter and sets are not tuples). Around it sits a small documented layer:

* the final-answer policy and normalisation of :mod:`stapo_jax.rewards.answer` (last complete box, text after
  ``</think>``, unterminated final box / unfinished reasoning / hedge earn nothing, thousands separators,
  units, degrees, percent, scientific notation, mixed numbers);
* a magnitude-safe numeric comparison (:func:`numbers_equal`), used for numbers and for numeric tuples, sets,
  intervals and matrices elementwise. math-verify's numeric path rounds floats to ``float_rounding`` decimal
  places and chops ``evalf`` differences below ``10**-numeric_precision``, so ``1/2004!`` equals ``1/2006!``
  and ``1e-7`` equals ``2e-7`` (huggingface/Math-Verify#14, #21). Here exact rationals compare exactly;
  other exact numbers (radicals, pi, factorials) compare at 60 and then 300 significant digits with a
  relative bound; an answer containing a decimal compares with the relative tolerance ``rel_tol``
  (default 1e-9): ``|a - b| <= rel_tol * max(|a|, |b|)``. No absolute rounding anywhere;
* percent: a prediction written as ``v%`` matches a gold ``v`` or ``v/100`` (and the other way round);
* inequality vs interval in both directions: a one-variable inequality is turned into its solution set when
  the other side is an interval or a union of intervals. A gold ``(a, b)`` of two finite numbers is
  ambiguous (a point or an open interval) and is not matched by ``a < x < b``.

Runs in a :class:`stapo_jax.rewards.VerifierPool` worker (math-verify's signal-based timeouts are off; the
pool kills a worker that exceeds the per-item timeout). Model output is parsed, never evaluated as code.
"""
from __future__ import annotations

import functools
import logging
import re
from typing import Any, Optional

from stapo_jax.rewards.answer import final_answer, normalize
from stapo_jax.rewards.registry import register_reward

DEFAULT_REL_TOL = 1e-9


def init_worker() -> None:
    """Pool-worker initializer: silence math-verify's warnings and warm the worker up (imports, the LaTeX
    parser, sympy's evalf), so a worker's first item does not spend its timeout on start-up.

    No arrays, returns None; raises ImportError if math-verify is missing. Source: math-verify's logger names
    (``math_verify``, ``latex2sympy2_extended``).
    """
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)
    verify_strict("so \\boxed{\\frac{1}{2} \\text{ cm}}", "0.5")


@functools.lru_cache(maxsize=1)
def _configs():
    """math-verify extraction configs: a boxed answer (box first), an anchored unboxed one."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    boxed = (LatexExtractionConfig(boxed_match_priority=0),)
    anchored = (LatexExtractionConfig(try_extract_without_anchor=False, boxed_match_priority=0),
                ExprExtractionConfig(try_extract_without_anchor=False))
    return boxed, anchored


def _first_expr(parsed: list) -> Any:
    """The first sympy object of a math-verify parse result, else its first string, else None."""
    from sympy import Basic, MatrixBase

    for p in parsed:
        if isinstance(p, (Basic, MatrixBase)):
            return p
    return parsed[0] if parsed else None


_SUBSCRIPTED_RE = re.compile(r"(?<![\\a-zA-Z])[A-Za-z]_")
_INT_RE = re.compile(r"^[-+]?\d+$")
_DEC_RE = re.compile(r"^[-+]?(?:\d+\.\d*|\.\d+)$")
_FRAC_RE = re.compile(r"^([-+]?)(?:\\[dt]?frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))$")


def _plain_number(text: str) -> Any:
    """An integer, decimal or simple fraction (``-\\frac{3}{4}``, ``3/4``) as a sympy number, without the
    LaTeX parser (the common case in RL training data; ~50 ms saved per answer); None for anything else.
    Decimals become Floats (compared with ``rel_tol``), the rest exact rationals."""
    from sympy import Float, Integer, Rational

    if _INT_RE.match(text):
        return Integer(text)
    if _DEC_RE.match(text):
        return Float(text, max(15, len(text)))
    m = _FRAC_RE.match(text)
    if m:
        num, den = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
        if int(den) != 0:
            return Rational(int(num), int(den)) * (-1 if m.group(1) == "-" else 1)
    return None


@functools.lru_cache(maxsize=1024)
def parse_answer(text: str) -> tuple[Any, bool, str]:
    """Normalise and parse one answer string (no surrounding prose): ``(expr, percent, normalised_text)``.

    ``expr`` is a sympy object, or the normalised string when math-verify cannot parse it (text answers),
    or None for an empty answer. Cached: the rollouts of a group often share their answer.

    No arrays: str in; ``expr`` a sympy object / str / None, ``percent`` a bool, the text a str. Never raises on a
    str (math-verify's ``parse`` returns [] on failure). Source: ``math_verify.parse`` with a boxed
    ``LatexExtractionConfig`` (verl ``utils/reward_score/math_verify.py`` convention).
    """
    from math_verify import parse

    norm = normalize(text)
    if not norm.text:
        return None, norm.percent, ""
    plain = _plain_number(norm.text)
    if plain is not None:
        return plain, norm.percent, norm.text
    boxed, _ = _configs()
    expr = _first_expr(parse("\\boxed{" + norm.text + "}", extraction_config=boxed, parsing_timeout=None))
    if expr is not None and not isinstance(expr, str) and _SUBSCRIPTED_RE.search(norm.text) \
            and not getattr(expr, "free_symbols", True):
        expr = None  # the parser dropped a subscripted symbol (``\\frac{1}{3} E_{1}`` -> 1/3): keep the text
    return (norm.text if expr is None else expr), norm.percent, norm.text


def parse_gold(gold: str) -> tuple[Any, bool, str]:
    """:func:`parse_answer` for a gold answer (cached there: a group of rollouts shares its gold).

    No arrays: str in, ``(sympy expr / str / None, bool, str)`` out; never raises on a str. Source: as
    :func:`parse_answer` (verl's gold-in-``\\boxed{}`` convention).
    """
    return parse_answer(gold)


def parse_prediction(response: str, require_think_close: bool = False) -> tuple[Any, bool, str, str]:
    """The graded answer of a response: ``(expr, percent, normalised_text, reason)``; ``expr`` is None when
    the policy gives no answer (``reason`` says why, see :class:`stapo_jax.rewards.answer.FinalAnswer`).

    No arrays: ``response`` a str, the result ``(sympy expr / str / None, bool, str, str)``; never raises on a str.
    Source: the final-answer policy of :mod:`stapo_jax.rewards.answer`, then math-verify's anchored
    ``ExprExtractionConfig`` / ``LatexExtractionConfig``.
    """
    fa = final_answer(response, require_think_close)
    if fa.text is None:
        return None, False, "", fa.reason
    expr, pct, norm = parse_answer(fa.text)
    if expr is None or (isinstance(expr, str) and fa.reason == "anchored"):
        from math_verify import parse

        _, anchored = _configs()
        got = _first_expr(parse("answer: " + fa.text, extraction_config=anchored, parsing_timeout=None))
        if got is not None and not isinstance(got, str):
            expr = got
    return expr, pct, norm, fa.reason


# --------------------------------------------------------------------------------------------- compare


def _is_number(x: Any) -> bool:
    from sympy import Expr

    try:
        return isinstance(x, Expr) and not x.free_symbols and bool(x.is_number)
    except Exception:
        return False


def _has_float(x: Any) -> bool:
    from sympy import Float

    return bool(x.atoms(Float))


def _rel_close(a, b, tol) -> Optional[bool]:
    """|a - b| <= tol * max(|a|, |b|) for evaluated sympy/mpmath numbers; None if not comparable (complex
    parts, NaN)."""
    from sympy import Float

    try:
        if a.is_real is False or b.is_real is False:
            ar, ai = a.as_real_imag()
            br, bi = b.as_real_imag()
            re_ok, im_ok = _rel_close(ar, br, tol), _rel_close(ai, bi, tol)
            return None if re_ok is None or im_ok is None else (re_ok and im_ok)
        if a == b:
            return True
        diff, scale = abs(a - b), max(abs(a), abs(b))
        if not (isinstance(diff, Float) and isinstance(scale, Float)):
            diff, scale = Float(diff, 30), Float(scale, 30)
        return bool(diff <= Float(tol) * scale)
    except Exception:
        return None


def numbers_equal(a: Any, b: Any, rel_tol: float = DEFAULT_REL_TOL) -> bool:
    """Magnitude-safe equality of two numeric sympy expressions (no free symbols).

    Exact rationals: exact equality. Other exact numbers: relative difference below 1e-50 at 60 significant
    digits and below 1e-280 at 300 digits (so ``sqrt(2**400 + 1)`` differs from ``2**200``). Either side with
    a decimal: relative difference at most ``rel_tol``. Never an absolute threshold: values of any magnitude
    (``1/2006!``, ``1e-300``, ``10**100``) compare by their leading digits.

    No arrays: ``a`` / ``b`` sympy numbers, ``rel_tol`` a float; returns a bool. Raises nothing of its own (sympy
    errors from ``evalf`` propagate; the pool counts them as errors). Source: replaces math-verify's rounding
    comparison (huggingface/Math-Verify#14, #21), issue 13.
    """
    from sympy import Rational

    if isinstance(a, Rational) and isinstance(b, Rational):
        return bool(a == b)
    if a == b:
        return True
    if _has_float(a) or _has_float(b):
        ok = _rel_close(a.evalf(30), b.evalf(30), rel_tol)
        return bool(ok)
    for digits, tol in ((60, 1e-50), (300, 1e-280)):
        ok = _rel_close(a.evalf(digits), b.evalf(digits), tol)
        if not ok:
            return False
    return True


def _pct_value(x: Any) -> Any:
    """latex2sympy writes ``v%`` as ``v * UnevaluatedExpr(1/100)``: return ``v`` (else ``x``)."""
    from sympy import Mul, Rational, UnevaluatedExpr

    if isinstance(x, Mul) and len(x.args) == 2 and x.args[1] == UnevaluatedExpr(Rational(1, 100)):
        return x.args[0]
    return x


def _as_set(rel: Any) -> Any:
    """The solution set of a one-variable inequality (a list of them is their disjunction), else None."""
    from sympy import And, FiniteSet, Or
    from sympy.core.relational import Relational

    if isinstance(rel, FiniteSet) and rel.args and all(isinstance(a, (Relational, And)) for a in rel.args):
        rel = Or(*rel.args)
    if isinstance(rel, (Relational, And, Or)) and len(rel.free_symbols) == 1:
        try:
            return rel.as_set()
        except Exception:
            return None
    return None


def exprs_equal(gold: Any, pred: Any, rel_tol: float = DEFAULT_REL_TOL) -> bool:
    """Gold-first equality of two parsed answers: :func:`numbers_equal` for numbers and elementwise for
    numeric tuples, finite sets, intervals, unions and matrices; inequality <-> interval conversion;
    otherwise ``math_verify.verify(gold, pred, strict=True)``.

    No arrays: parsed answers (sympy objects, str or None), ``rel_tol`` a float; returns a bool. Raises nothing of
    its own (sympy / math-verify errors propagate; the pool counts them). Source: ``math_verify.verify`` (gold
    first, ``strict=True``) plus the issue-13 layer (module docstring).
    """
    from sympy import Eq, FiniteSet, Interval, MatrixBase, Tuple, Union

    if gold is None or pred is None:
        return False
    if isinstance(gold, str) or isinstance(pred, str):
        return isinstance(gold, str) and isinstance(pred, str) and gold.strip() == pred.strip() != ""
    gold, pred = _pct_value(gold), _pct_value(pred)
    # a prediction "x = v" against a gold value v: grade v (math-verify's convention)
    if isinstance(pred, Eq) and not isinstance(gold, Eq) and not gold.free_symbols:
        pred = pred.rhs
    if isinstance(gold, Eq) and isinstance(pred, Eq) and gold.lhs == pred.lhs:
        return exprs_equal(gold.rhs, pred.rhs, rel_tol)
    if isinstance(gold, Eq) and not isinstance(pred, Eq) and len(gold.lhs.free_symbols) == 1 \
            and gold.lhs.is_Symbol and not gold.rhs.free_symbols:
        gold = gold.rhs
    intervals = (Interval, Union)
    if isinstance(gold, intervals) and not isinstance(pred, intervals + (Tuple,)):
        if isinstance(gold, Interval) and not any(e.is_infinite for e in (gold.start, gold.end)) \
                and gold.left_open and gold.right_open:
            return False  # "(a, b)": a point or an interval; an inequality does not settle it
        converted = _as_set(pred)
        pred = pred if converted is None else converted
    if isinstance(pred, intervals) and not isinstance(gold, intervals + (Tuple,)):
        converted = _as_set(gold)
        gold = gold if converted is None else converted
    if _is_number(gold) and _is_number(pred):
        return numbers_equal(gold, pred, rel_tol)
    if isinstance(gold, Tuple) and isinstance(pred, Tuple):
        return len(gold) == len(pred) and all(exprs_equal(g, p, rel_tol) for g, p in zip(gold, pred))
    if isinstance(gold, FiniteSet) and isinstance(pred, FiniteSet):
        left = list(pred.args)
        for g in gold.args:
            hit = next((i for i, p in enumerate(left) if exprs_equal(g, p, rel_tol)), None)
            if hit is None:
                return False
            left.pop(hit)
        return not left
    if isinstance(gold, Interval) and isinstance(pred, Interval):
        return (gold.left_open, gold.right_open) == (pred.left_open, pred.right_open) \
            and _end_equal(gold.start, pred.start, rel_tol) and _end_equal(gold.end, pred.end, rel_tol)
    if isinstance(gold, Union) and isinstance(pred, Union):
        return len(gold.args) == len(pred.args) and all(
            any(exprs_equal(g, p, rel_tol) for p in pred.args) for g in gold.args)
    if isinstance(gold, MatrixBase) and isinstance(pred, MatrixBase):
        return gold.shape == pred.shape and all(exprs_equal(g, p, rel_tol) for g, p in zip(gold, pred))
    if _is_number(gold) != _is_number(pred) and (_is_number(gold) or _is_number(pred)) \
            and not (gold.free_symbols or pred.free_symbols):
        return False  # a number against a set/tuple/matrix
    from math_verify import verify

    return bool(verify(gold, pred, float_rounding=15, numeric_precision=300, strict=True, timeout_seconds=None))


def _end_equal(a, b, rel_tol) -> bool:
    if a.is_infinite or b.is_infinite:
        return bool(a == b)
    return exprs_equal(a, b, rel_tol)


def verify_strict(response: str, gold: str, rel_tol: float = DEFAULT_REL_TOL,
                  require_think_close: bool = False) -> bool:
    """True iff the final answer of ``response`` equals ``gold`` under the strict policy (module docstring).

    Args:
      response: model output (str, any length).
      gold: reference answer (str, e.g. ``"\\frac{14}{3}"``, ``"1,000"``, ``"(-\\infty, 3)"``).
      rel_tol: relative tolerance for answers containing decimals (> 0; default 1e-9).
      require_think_close: thinking-mode run: a response without ``</think>`` has no answer.
    Returns:
      bool; an unparseable gold or a missing answer gives False.
    Raises:
      TypeError: a non-str ``response`` or ``gold``.
      ValueError: ``rel_tol`` <= 0.
    """
    if not isinstance(response, str) or not isinstance(gold, str):
        raise TypeError(f"response and gold must be str, got {type(response).__name__}, {type(gold).__name__}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol={rel_tol} must be > 0")
    fa = final_answer(response, require_think_close)
    if fa.text is None:
        return False
    norm = normalize(fa.text)
    if norm.text and (norm.text, norm.percent) == normalize(gold):
        return True  # the same normalised string: no parsing needed
    g, g_pct, g_text = parse_gold(gold)
    p, p_pct, p_text, _ = parse_prediction(response, require_think_close)
    if g is None or p is None:
        return False
    if exprs_equal(g, p, rel_tol):
        return True
    if p_pct != g_pct and _is_number(g) and _is_number(p):  # "50%" for 0.5 (or 50), and the other way round
        from sympy import Integer

        scaled = (p / Integer(100)) if p_pct else (g / Integer(100))
        return numbers_equal(g if p_pct else scaled, scaled if p_pct else p, rel_tol)
    return False


@register_reward("math_verify_strict", pooled=True,
                 options={"rel_tol": "rel_tol", "require_think_close": "require_think_close"})
def verify_one(response: str, gold: str, rel_tol: float = DEFAULT_REL_TOL, require_think_close: bool = False) -> float:
    """Pool entry point: 1.0 if :func:`verify_strict` accepts, else 0.0.

    No arrays: str response and gold, float ``rel_tol``; returns a float (1.0 / 0.0). Raises TypeError (a non-str
    argument) or ValueError (``rel_tol <= 0``) from :func:`verify_strict`. Source: verl's ``compute_score``
    pool-entry convention (one float per response).
    """
    return 1.0 if verify_strict(response, gold, rel_tol, require_think_close) else 0.0
