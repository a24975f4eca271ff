"""Answer forms that must not reach sympy's arithmetic, and comparisons math-verify does not make
(``reward.kind: math_verify_strict``, issue 36).

* **Unsafe values.** latex2sympy reads a clock time ``11:00`` as ``11/0``, i.e. complex infinity ``zoo``, and
  ``zoo == zoo``: ``3:00`` matched ``11:00`` (huggingface/Math-Verify#14). A parse that contains ``zoo`` or
  ``nan`` (a division by zero, ``0/0``) is never compared (:func:`is_unsafe`: the verdict is 0 and the item is
  counted as unparsed); ``oo`` compares only structurally (``oo == oo``), never numerically.
* **Times, ratios, scores** get their own form (:func:`special_form`), parsed before math-verify:
  ``H:MM[:SS] [am|pm]`` (hours 0-23, or 24:00) is a time (equal iff the same time of day), other colon lists of
  numbers ``a:b[:c]`` are ratios (equal iff proportional, all parts non-zero; a two-part ratio also equals the
  number ``a/b``), and ``a-b`` of two non-negative integers is a score (equal iff the same pair; never the difference).
* **Entries rounded to the gold's precision** (:func:`rounded_entries_match`): a tuple, interval or matrix gold
  whose entries are decimals with at least two decimal places (``(0.29, 0.196, -0.186)``) accepts a prediction
  whose entries round (half up) to them (``0.290243531...``; huggingface/Math-Verify#2, #3).
"""
from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, NamedTuple, Optional

_TIME_RE = re.compile(r"^(\d{1,2}):([0-5]\d)(?::([0-5]\d))?\s*(?:\\text\{\s*)?([ap])?\.?\s*(?:m\.?)?\s*\}?$", re.I)
_RATIO_RE = re.compile(r"^\d+(?:\.\d+)?(?:\s*(?::|\\colon)\s*\d+(?:\.\d+)?)+$")
_SCORE_RE = re.compile(r"^(\d+)\s*-\s*(\d+)$")
_SPLIT_RE = re.compile(r"\s*(?::|\\colon)\s*")
_DECIMAL_RE = re.compile(r"[-+]?\d*\.\d+|[-+]?\d+")
MIN_ROUNDED_PLACES = 2


class AnswerForm(NamedTuple):
    """A time (``kind="time"``, ``parts`` = (hours 0-23, minutes, seconds)), a ratio (``"ratio"``, parts as
    Fractions) or a score (``"score"``, two ints)."""

    kind: str
    parts: tuple


def special_form(text: str) -> Optional[AnswerForm]:
    """The :class:`AnswerForm` of a normalised answer string, or None for an ordinary answer.

    Examples: ``"11:00"`` -> time (11, 0, 0); ``"3:00 pm"`` -> time (15, 0, 0); ``"2:3"`` -> ratio (2, 3);
    ``"1:2:3"`` -> ratio; ``"3-1"`` -> score (3, 1); ``"x-1"``, ``"-3"`` -> None.

    Str in, :class:`AnswerForm` or None out; never raises. Source: issue 36 (clock times read as
    ``H/0``, huggingface/Math-Verify#14).
    """
    s = text.strip()
    if not s or not s[0].isdigit():
        return None
    m = _TIME_RE.match(s)
    if m:
        hours, minutes, seconds = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
        if m.group(4):
            if not 1 <= hours <= 12:
                return None
            hours = hours % 12 + (12 if m.group(4).lower() == "p" else 0)
        if hours < 24 or (hours == 24 and minutes == seconds == 0):
            return AnswerForm("time", (hours % 24, minutes, seconds))
    if _RATIO_RE.match(s):
        return AnswerForm("ratio", tuple(Fraction(p) for p in _SPLIT_RE.split(s)))
    m = _SCORE_RE.match(s)
    if m:
        return AnswerForm("score", (int(m.group(1)), int(m.group(2))))
    return None


def forms_equal(gold: AnswerForm, pred: AnswerForm) -> bool:
    """Gold-first equality of two :class:`AnswerForm` answers (see the module docstring): times and scores
    equal iff the same parts, ratios iff proportional (all parts non-zero; else the same parts).

    Two AnswerForms; returns a bool; never raises. Source: issue 36.
    """
    if gold.kind != pred.kind or len(gold.parts) != len(pred.parts):
        return False
    if gold.kind != "ratio" or 0 in gold.parts or 0 in pred.parts:
        return gold.parts == pred.parts
    scale = pred.parts[0] / gold.parts[0]
    return all(p == g * scale for g, p in zip(gold.parts, pred.parts))


def ratio_value(form: AnswerForm) -> Optional[Fraction]:
    """``a/b`` of a two-part ratio ``a:b`` with ``b != 0`` (it also equals that number), else None (times,
    scores and longer ratios never equal a number).

    An AnswerForm; returns a Fraction or None; never raises. Source: issue 36.
    """
    if form.kind == "ratio" and len(form.parts) == 2 and form.parts[1] != 0:
        return form.parts[0] / form.parts[1]
    return None


def is_unsafe(expr: Any) -> bool:
    """True iff a parsed answer contains complex infinity ``zoo`` or ``nan`` (a division by zero, ``0/0``, a
    clock time read as ``H/0``): such a parse is never compared.

    A parsed answer (sympy object, :class:`AnswerForm`, str or None); returns a bool; never raises.
    Source: issue 36.
    """
    from sympy import Basic, MatrixBase, S

    try:
        if isinstance(expr, MatrixBase):
            return any(is_unsafe(e) for e in expr)
        return isinstance(expr, Basic) and bool(expr.has(S.ComplexInfinity, S.NaN))
    except Exception:
        return True


def has_infinity(expr: Any) -> bool:
    """True iff a sympy expression contains ``oo`` / ``-oo`` (compared only structurally).

    A sympy object; returns a bool; never raises. Source: issue 36.
    """
    from sympy import S

    try:
        return bool(expr.has(S.Infinity, S.NegativeInfinity))
    except Exception:
        return True


def _entries(x: Any) -> Optional[tuple[str, tuple, list]]:
    """``(kind, shape, entries)`` of a tuple, interval or matrix, else None."""
    from sympy import Interval, MatrixBase, Tuple

    if isinstance(x, Tuple):
        return "tuple", (len(x),), list(x.args)
    if isinstance(x, Interval):
        return "interval", (x.left_open, x.right_open), [x.start, x.end]
    if isinstance(x, MatrixBase):
        return "matrix", x.shape, list(x)
    return None


def rounded_entries_match(gold: Any, gold_text: str, pred: Any) -> bool:
    """True iff ``gold`` is a tuple / interval / matrix of decimals given to at least
    :data:`MIN_ROUNDED_PLACES` decimal places (as written in ``gold_text``) and every entry of ``pred`` (the
    same kind and shape, numeric entries) rounds half up to the gold entry at that entry's number of places.

    Example: gold ``"(0.29, 0.196)"``, prediction ``(0.290243, 0.196008)`` -> True; ``(0.2951, 0.196)`` -> False.

    Parsed answers (sympy objects) and the gold's normalised text; returns a bool; never raises.
    Source: huggingface/Math-Verify#2 and #3 (a vector of long decimals against a gold rounded to 2-3 places).
    """
    g, p = _entries(gold), _entries(pred)
    if g is None or p is None or g[:2] != p[:2]:
        return False
    literals = _DECIMAL_RE.findall(gold_text)
    if len(literals) != len(g[2]):
        return False
    try:
        for lit, g_entry, p_entry in zip(literals, g[2], p[2]):
            places = len(lit.split(".")[1]) if "." in lit else 0
            if places < MIN_ROUNDED_PLACES or not p_entry.is_number or p_entry.free_symbols \
                    or abs(float(g_entry) - float(lit)) > 1e-12 * max(1.0, abs(float(lit))):
                return False
            quantum = Decimal(1).scaleb(-places)
            value = Decimal(str(p_entry.evalf(places + 15))).quantize(quantum, rounding=ROUND_HALF_UP)
            if value != Decimal(lit).quantize(quantum):
                return False
    except (InvalidOperation, TypeError, ValueError, AttributeError):
        return False
    return True
