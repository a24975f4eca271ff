"""Hardened math-verify grading (``reward.kind: math_verify_strict``; issues 13 and 36).

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
  the other side is an interval or a union of intervals; a gold ``(a, b)`` is matched by ``a < x < b`` (the
  answer only makes sense for the interval);
* degrees: a prediction written with a degree mark matches a gold in radians (``30^\\circ`` for
  ``\\frac{\\pi}{6}``), and the other way round; bare ``pi`` / ``sqrt(...)`` and Unicode math read as LaTeX;
* unsafe parses, times, ratios, scores, entries rounded to the gold's places (:mod:`.forms`): a parse with
  ``zoo`` / ``nan`` (a division by zero, a clock time read as ``H/0``) is never compared: it keeps its text
  (only the identical text matches) and a refusal is counted as unparsed (:func:`grade`, ``reward/n_unparsed``);
  ``oo`` compares only structurally;
* radicals: two expressions with radicals also match when equal for positive symbols
  (``\\sqrt{1/m}`` = ``\\frac{1}{\\sqrt{m}}``; huggingface/Math-Verify#64).

Runs in a :class:`stapo_jax.rewards.VerifierPool` worker (math-verify's signal-based timeouts are off; the
pool kills a worker that exceeds the per-item timeout). Model output is parsed, never evaluated as code.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

from stapo_jax.core.errors import ConfigError
from stapo_jax.core.settings import check_field_types

from stapo_jax.rewards.answer import Normalized, final_answer, normalize, unicode_to_latex
from stapo_jax.rewards.forms import (AnswerForm, forms_equal, has_infinity, is_unsafe, ratio_value,
                                     rounded_entries_match, special_form)
from stapo_jax.rewards.registry import register_reward

DEFAULT_REL_TOL = 1e-9


def init_worker() -> None:
    """Pool-worker initializer: silence math-verify's warnings and warm the worker up (imports, the LaTeX
    parser, sympy's evalf), so a worker's first item does not spend its timeout on start-up.

    Returns None; raises ImportError if math-verify is missing. Source: math-verify's logger names
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
def parse_answer(text: str) -> tuple[Any, Normalized, bool]:
    """Normalise and parse one answer string (no surrounding prose): ``(expr, normalized, unsafe)``.

    ``expr`` is a sympy object, an :class:`~stapo_jax.rewards.forms.AnswerForm` (a time, ratio or score), or the
    normalised string when math-verify cannot parse it (text answers) or its parse contains ``zoo`` / ``nan``
    (``unsafe`` is then True: such a parse is never compared, the text only matches the identical text), or None
    for an empty answer; ``normalized`` is the :class:`~stapo_jax.rewards.answer.Normalized` text with its
    percent and degree flags. Cached: the rollouts of a group often share their answer.

    Str in; ``expr`` a sympy object / AnswerForm / str / None, ``unsafe`` a bool. Never raises on a str
    (math-verify's ``parse`` returns [] on failure). Source: ``math_verify.parse`` with a boxed
    ``LatexExtractionConfig`` (verl ``utils/reward_score/math_verify.py`` convention).
    """
    from math_verify import parse

    norm = normalize(text)
    if not norm.text:
        return None, norm, False
    form = special_form(norm.text)
    if form is not None:
        return form, norm, False
    plain = _plain_number(norm.text)
    if plain is not None:
        return plain, norm, False
    boxed, _ = _configs()
    expr = _first_expr(parse("\\boxed{" + norm.text + "}", extraction_config=boxed, parsing_timeout=None))
    if expr is not None and not isinstance(expr, str) and _SUBSCRIPTED_RE.search(norm.text) \
            and not getattr(expr, "free_symbols", True):
        expr = None  # the parser dropped a subscripted symbol (``\\frac{1}{3} E_{1}`` -> 1/3): keep the text
    unsafe = is_unsafe(expr)
    return (norm.text if expr is None or unsafe else expr), norm, unsafe


def parse_gold(gold: str) -> tuple[Any, Normalized, bool]:
    """:func:`parse_answer` for a gold answer (cached there: a group of rollouts shares its gold).

    Str in, ``(sympy expr / AnswerForm / str / None, Normalized, bool)`` out; never raises on a str. Source:
    as :func:`parse_answer` (verl's gold-in-``\\boxed{}`` convention).
    """
    return parse_answer(gold)


def parse_prediction(response: str, require_think_close: bool = False) -> tuple[Any, Normalized, bool, str]:
    """The graded answer of a response: ``(expr, normalized, unsafe, reason)`` (as :func:`parse_answer`);
    ``expr`` is None when the policy gives no answer (``reason`` says why, see
    :class:`stapo_jax.rewards.answer.FinalAnswer`).

    ``response`` a str, the result ``(sympy expr / AnswerForm / str / None, Normalized, bool, str)``; never
    raises on a str. Source: the final-answer policy of :mod:`stapo_jax.rewards.answer`, then math-verify's
    anchored ``ExprExtractionConfig`` / ``LatexExtractionConfig``.
    """
    fa = final_answer(response, require_think_close)
    if fa.text is None:
        return None, Normalized("", False), False, fa.reason
    expr, norm, unsafe = parse_answer(fa.text)
    if expr is None or (isinstance(expr, str) and fa.reason == "anchored"):
        from math_verify import parse

        _, anchored = _configs()
        got = _first_expr(parse("answer: " + unicode_to_latex(fa.text), extraction_config=anchored,
                                parsing_timeout=None))
        if got is not None and not isinstance(got, str):
            if is_unsafe(got):
                unsafe = True
            else:
                expr = got
    return expr, norm, unsafe, fa.reason


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

    ``a`` / ``b`` sympy numbers, ``rel_tol`` a float; returns a bool. Raises nothing of its own (sympy
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

    Parsed answers (sympy objects, str or None), ``rel_tol`` a float; returns a bool. Raises nothing of
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
    if isinstance(gold, AnswerForm) and isinstance(pred, AnswerForm):
        return forms_equal(gold, pred)
    if isinstance(gold, AnswerForm) or isinstance(pred, AnswerForm):  # a ratio a:b also equals a/b
        from sympy import Rational

        form, other = (gold, pred) if isinstance(gold, AnswerForm) else (pred, gold)
        value = ratio_value(form)
        return value is not None and _is_number(other) and not has_infinity(other) and numbers_equal(
            Rational(value.numerator, value.denominator), other, rel_tol)
    intervals = (Interval, Union)
    if isinstance(gold, intervals) and not isinstance(pred, intervals + (Tuple,)):
        # "(a, b)" may be a point, but an answer "a < x < b" only makes sense for the interval (issue 36)
        converted = _as_set(pred)
        pred = pred if converted is None else converted
    if isinstance(pred, intervals) and not isinstance(gold, intervals + (Tuple,)):
        converted = _as_set(gold)
        gold = gold if converted is None else converted
    if _is_number(gold) and _is_number(pred):
        if has_infinity(gold) or has_infinity(pred):
            return bool(gold == pred)  # oo compares structurally, never numerically (issue 36)
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


def grade(response: str, gold: str, rel_tol: float = DEFAULT_REL_TOL,
          require_think_close: bool = False) -> tuple[bool, bool]:
    """``(accepted, unparsed)`` for one response: ``accepted`` as :func:`verify_strict`; ``unparsed`` is True
    when the gold or the graded answer cannot be compared safely and is not accepted (an empty gold, or a parse
    containing ``zoo`` / ``nan``: a division by zero, a clock time read as ``H/0``; such an answer is never
    compared, only its identical normalised text matches).

    Str response and gold, float ``rel_tol``, bool flag; returns two bools. Raises TypeError (a non-str
    argument) and ValueError (``rel_tol <= 0``). Source: issue 13's policy plus issue 36's safety rules
    (module docstring, :mod:`stapo_jax.rewards.forms`).
    """
    if not isinstance(response, str) or not isinstance(gold, str):
        raise TypeError(f"response and gold must be str, got {type(response).__name__}, {type(gold).__name__}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol={rel_tol} must be > 0")
    fa = final_answer(response, require_think_close)
    if fa.text is None:
        return False, False
    g, g_norm, g_unsafe = parse_gold(gold)
    if g is None:
        return False, True
    if normalize(fa.text) == g_norm:
        return True, False  # the same normalised string: no comparison needed
    p, p_norm, p_unsafe, _ = parse_prediction(response, require_think_close)
    if g_unsafe or p_unsafe:
        return False, True
    if p is None:
        return False, False
    return _equal_any_form(g, g_norm, p, p_norm, rel_tol), False


def _equal_any_form(g: Any, g_norm: Normalized, p: Any, p_norm: Normalized, rel_tol: float) -> bool:
    """exprs_equal, then the percent, degree <-> radian, rounded-entries and positive-radical readings."""
    if exprs_equal(g, p, rel_tol):
        return True
    if isinstance(g, (str, AnswerForm)) or isinstance(p, (str, AnswerForm)):
        return False
    from sympy import Integer, pi

    if _is_number(g) and _is_number(p) and not (has_infinity(g) or has_infinity(p)):
        if p_norm.percent != g_norm.percent:  # "50%" for 0.5 (or 50), and the other way round
            scaled = (p / Integer(100)) if p_norm.percent else (g / Integer(100))
            if numbers_equal(g if p_norm.percent else scaled, scaled if p_norm.percent else p, rel_tol):
                return True
        if p_norm.degree != g_norm.degree:  # "30^\\circ" for pi/6, and the other way round
            g_rad = g * pi / 180 if g_norm.degree else g
            p_rad = p * pi / 180 if p_norm.degree else p
            return numbers_equal(g_rad, p_rad, rel_tol)
        return False
    return rounded_entries_match(g, g_norm.text, p) or _positive_radicals_equal(g, p)


def _positive_radicals_equal(g: Any, p: Any) -> bool:
    """Both sides are expressions with radicals in at most 3 symbols and no ``Abs``: equal when every symbol is
    taken positive (``\\sqrt{1/m}`` = ``1/\\sqrt{m}``; huggingface/Math-Verify#64)."""
    from sympy import Abs, Expr, Pow, Symbol, simplify

    if not (isinstance(g, Expr) and isinstance(p, Expr)):
        return False
    syms = g.free_symbols | p.free_symbols
    if not syms or len(syms) > 3 or g.has(Abs) or p.has(Abs):
        return False
    if not all(any(not a.exp.is_integer for a in e.atoms(Pow)) for e in (g, p)):
        return False
    sub = {s: Symbol(s.name, positive=True) for s in syms}
    diff = g.subs(sub) - p.subs(sub)
    if diff == 0:
        return True
    return diff.count_ops() <= 60 and simplify(diff) == 0


def verify_strict(response: str, gold: str, rel_tol: float = DEFAULT_REL_TOL,
                  require_think_close: bool = False) -> bool:
    """True iff the final answer of ``response`` equals ``gold`` under the strict policy (module docstring).

    Args:
      response: model output (str, any length).
      gold: reference answer (str, e.g. ``"\\frac{14}{3}"``, ``"1,000"``, ``"(-\\infty, 3)"``, ``"11:00"``).
      rel_tol: relative tolerance for answers containing decimals (> 0; default 1e-9).
      require_think_close: thinking-mode run: a response without ``</think>`` has no answer.
    Returns:
      bool; an unparseable or unsafe gold (``zoo``, ``nan``) or a missing answer gives False.
    Raises:
      TypeError: a non-str ``response`` or ``gold``.
      ValueError: ``rel_tol`` <= 0.
    """
    return grade(response, gold, rel_tol, require_think_close)[0]


def verify_one(response: str, gold: str, rel_tol: float = DEFAULT_REL_TOL, require_think_close: bool = False) -> float:
    """1.0 if :func:`verify_strict` accepts, else 0.0.

    Str response and gold, float ``rel_tol``; returns a float (1.0 / 0.0). Raises TypeError (a non-str
    argument) or ValueError (``rel_tol <= 0``) from :func:`verify_strict`. Source: verl's ``compute_score``
    pool-entry convention (one float per response).
    """
    return 1.0 if verify_strict(response, gold, rel_tol, require_think_close) else 0.0


@dataclass(frozen=True)
class MathStrictSettings:
    """The ``math_verify_strict`` reward's own settings: the run config's ``reward.math_verify_strict`` section.

    rel_tol: relative tolerance (> 0, unitless) of the magnitude-safe numeric comparison for answers with decimals.
    require_think_close: a response without ``</think>`` has no answer (thinking templates that pre-fill
    ``<think>`` in the prompt). Raises: ConfigError naming ``reward.math_verify_strict.<key>``.
    Source: issue 13 (the strict verifier); math-verify's numeric comparison.
    """

    rel_tol: float = DEFAULT_REL_TOL
    require_think_close: bool = False

    def __post_init__(self):
        check_field_types(self, "reward.math_verify_strict")
        if not self.rel_tol > 0:
            raise ConfigError(f"reward.math_verify_strict.rel_tol={self.rel_tol} must be > 0")


@register_reward("math_verify_strict", pooled=True, settings_cls=MathStrictSettings,
                 section="reward.math_verify_strict")
def score_one(response: str, gold: str, rel_tol: float = DEFAULT_REL_TOL,
              require_think_close: bool = False) -> tuple[float, bool]:
    """Pool entry point: ``(score, unparsed)`` from :func:`grade` (score 1.0 / 0.0; ``unparsed`` counted as
    ``reward/n_unparsed``).

    Str response and gold, float ``rel_tol``; returns ``(float, bool)``. Raises as :func:`grade`.
    Source: verl's ``compute_score`` convention plus issue 36's unparsed count.
    """
    ok, unparsed = grade(response, gold, rel_tol, require_think_close)
    return (1.0 if ok else 0.0), unparsed
