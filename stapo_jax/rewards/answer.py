"""Final-answer policy and answer-string normalisation for ``reward.kind: math_verify_strict``.

This is the small layer in front of math-verify that its own options cannot express (issue 13). It is pure
string processing (no sympy), so it is cheap and total on any input.

Final-answer policy (:func:`final_answer`):

1. **Thinking models.** If the response contains ``</think>``, only the text after the last ``</think>`` is
   read. A response that opens ``<think>`` but never closes it is unfinished reasoning and has no answer
   (a box inside it earns nothing; TRL ``reasoning_accuracy_reward``, huggingface/trl#4563). With
   ``require_think_close`` (thinking-mode runs whose template pre-fills ``<think>``) a response without
   ``</think>`` has no answer either.
2. **Boxes.** The answer is the last complete ``\\boxed{...}`` (or ``\\fbox{...}``). If the last box is
   unterminated (the response stops inside it) there is no answer, even when an earlier box is complete.
   Boxes separated only by connectors (``,``, ``and``, ``or``, ``\\quad``, ``x =``) form one multi-part
   answer, joined with commas (so ``\\boxed{2} or \\boxed{3}`` is the set {2, 3}: right for the roots
   {2, 3}, a hedge for a single gold value). An earlier box superseded by later text is a self-correction:
   the last box counts ("maybe I made an error ... \\boxed{4}"), unless the text between them offers an
   alternative (``alternatively``, ``either``, ``or maybe``, ``could also be``, ...), which earns nothing.
3. **No box.** An anchored final answer counts: ``final answer is X``, ``answer: X``, ``answer is X``,
   ``#### X`` (GSM8K), read to the end of its sentence; after ``</think>`` a short answer region (one line)
   is the answer itself. An unanchored number in running text is not an answer (a truncated derivation
   must not be graded by its last intermediate value; Tencent-Hunyuan/UniRL#360).

Normalisation (:func:`normalize`), applied to the gold and the prediction alike: thousands separators (comma,
``{,}``, thin spaces ``\\,`` ``\\;`` ``\\!`` ``\\thinspace``, U+2009, U+202F), ``\\text{}``-style wrappers
around numbers, trailing units in ``\\text{}``, degree marks, percent (returned as a flag; the comparator
accepts the value or the value / 100), scientific notation ``3.2e5``, plain mixed numbers ``2 1/2``,
``x \\in S`` -> ``S``, markdown bold, ``$`` and ``\\displaystyle``; Unicode math (``−`` U+2212, ``√``, ``π``,
``∞``, ``≤``, ``≥``, ``×``, ``÷``, ``·``, ``²``, ``³``) and bare ``pi`` / ``sqrt(...)`` written as LaTeX (the
parser reads a bare ``pi`` as the product p·i; huggingface/Math-Verify#69). Degree marks are removed and
reported as a flag (the comparator also accepts the angle in radians).
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

from stapo_jax.rewards.boxed import closing_brace

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")

# a gap between two boxes that only joins parts of one answer
_CONNECTOR_RE = re.compile(r"^(?:[\s$.,;:&]|\\[,;!:]|\\q?quad|\\text\s*\{\s*(?:and|or|,)?\s*\}|\band\b|\bor\b|"
                           r"\\(?:\[|\]|\(|\))|[a-zA-Z](?:_\{?\w+\}?)?\s*=)*$")
_HEDGE_RE = re.compile(r"\b(?:alternatively|alternative (?:answer|value|solution)|either|or (?:maybe|possibly|perhaps)|"
                       r"could also be|might also be|may also be|another possib\w*|not sure|unsure)\b", re.IGNORECASE)
_ANCHOR_RE = re.compile(r"(?:final answer(?: is)?|answer is|answer\s*:|####)\s*:?\s*", re.IGNORECASE)
_HEDGE_OR_RE = re.compile(r"(?:\d|\})\s*\$?\s*(?:,\s*)?(?:\bor\b|\\text\s*\{\s*or\s*\})", re.IGNORECASE)


class FinalAnswer(NamedTuple):
    """The answer text to grade (``None``: the response has none) and why (``reason``):
    ``boxed``, ``boxed_multi``, ``anchored``, ``short_final``, ``no_answer``, ``unfinished_think``,
    ``unterminated_box``, ``hedge``."""

    text: Optional[str]
    reason: str


def answer_region(response: str, require_think_close: bool = False) -> Optional[str]:
    """The part of ``response`` that may hold the final answer, or None for unfinished reasoning.

    ``response`` is a str, the result a str (suffix of ``response``) or None; never raises. Source: TRL
    ``reasoning_accuracy_reward`` (text after ``</think>``; huggingface/trl#4563), the module's policy rule 1.
    """
    close = response.rfind(THINK_CLOSE)
    if close >= 0:
        return response[close + len(THINK_CLOSE):]
    if THINK_OPEN in response or require_think_close:
        return None
    return response


def final_answer(response: str, require_think_close: bool = False) -> FinalAnswer:
    """Apply the final-answer policy (module docstring) to one response.

    Args:
      response: decoded model output (str).
      require_think_close: the run uses a thinking template; no ``</think>`` means no answer.
    Returns:
      :class:`FinalAnswer` (``text`` is the raw, un-normalised answer string or None).

    Str in, :class:`FinalAnswer` (str-or-None ``text``, str ``reason``) out; pure string processing,
    never raises on a str. Source: the policy of issue 13 (module docstring), boxes brace-matched as verl's
    ``math_dapo.last_boxed_only_string``.
    """
    region = answer_region(response, require_think_close)
    if region is None:
        return FinalAnswer(None, "unfinished_think")
    boxes = []  # (start, content_start, end) of complete boxes
    for m in _BOX_RE.finditer(region):
        end = closing_brace(region, m.end() - 1)
        if end < 0:
            if not boxes or m.start() > boxes[-1][2]:
                return FinalAnswer(None, "unterminated_box")
            continue
        if boxes and m.start() < boxes[-1][2]:
            continue  # a box nested inside the previous one
        boxes.append((m.start(), m.end(), end))
    if boxes:
        group = [boxes[-1]]
        for prev in reversed(boxes[:-1]):
            gap = region[prev[2] + 1:group[0][0]]
            if _CONNECTOR_RE.match(gap):
                group.insert(0, prev)
                continue
            if _HEDGE_RE.search(gap) and region[prev[1]:prev[2]].strip() != region[group[0][1]:group[0][2]].strip():
                return FinalAnswer(None, "hedge")
            break
        parts = []
        for _, cs, ce in group:
            part = region[cs:ce].strip()
            if part not in parts:
                parts.append(part)
        if len(parts) == 1:
            return FinalAnswer(parts[0], "boxed")
        return FinalAnswer(", ".join(parts), "boxed_multi")
    anchors = list(_ANCHOR_RE.finditer(region))
    if anchors:
        tail = region[anchors[-1].end():]
        tail = re.split(r"(?<!\\)\.(?:\s|$)|\n\s*\n|(?<=\$)\.", tail.strip(), maxsplit=1)[0]
        if _HEDGE_OR_RE.search(tail) or _HEDGE_RE.search(tail):
            return FinalAnswer(None, "hedge")
        return FinalAnswer(tail.strip(), "anchored") if tail.strip() else FinalAnswer(None, "no_answer")
    if THINK_CLOSE in response:
        short = region.strip()
        if short and "\n" not in short and len(short) <= 80:
            return FinalAnswer(short.rstrip("."), "short_final")
    return FinalAnswer(None, "no_answer")


# ------------------------------------------------------------------------------------------ normalisation

# thin spaces and braced commas always separate thousands; a plain comma only in an answer that is nothing but
# the number ("1,000"), since "[1,100]" and "1,234" elsewhere are lists
_SEP = r"(?:\{,\}|\\,|\\;|\\!|\\thinspace|\\ |\u2009|\u202f|\u00a0)"
_THOUSANDS_RE = re.compile(r"(?<![\d.,])(-?\d{1,3})((?:" + _SEP + r"\d{3})+)(?![\d])(?!" + _SEP + r"\d)")
_SEP_RE = re.compile(_SEP)
_COMMA_NUMBER_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree\b|\^\s*\{\s*\\text\{\s*o\s*\}\s*\}")
_PERCENT_RE = re.compile(r"\s*(?:\\%|%|\\text\{\s*\\?%\s*\}|\\text\{\s*percent\s*\}|\bpercent\b)\s*$")
_WRAP_RE = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|textrm)\s*\{\s*([-+]?[\d.,\s/]+)\s*\}")
_UNIT_RE = re.compile(r"(?<=[\d}.)])\s*(?:\\[,;! ]\s*)*\\(?:text|mbox|mathrm|textrm)\s*\{\s*[a-zA-Z][a-zA-Z .]*\}"
                      r"(?:\s*\^\s*\{?\d\}?)?\s*$")
_SCI_RE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*[eE]\s*([+-]?\d+)(?![\w.])")
_MIXED_RE = re.compile(r"^(-?)(\d+)\s+(\d+)\s*/\s*(\d+)$")
_IN_RE = re.compile(r"^\s*[a-zA-Z](?:_\{?\w+\}?)?\s*\\in\s+")
_STRIP_RE = re.compile(r"\\displaystyle|\*\*|\\!")
_UNICODE = {"\u2212": "-", "\u2013": "-", "\u03c0": "\\pi ", "\u221e": "\\infty ", "\u2264": "\\le ",
            "\u2265": "\\ge ", "\u00d7": "\\times ", "\u00f7": "\\div ", "\u00b7": "\\cdot ", "\u22c5": "\\cdot ",
            "\u00b2": "^2", "\u00b3": "^3"}
_UNICODE_RE = re.compile("|".join(_UNICODE))
# "√(a+b)", "√{a+b}", "√3", "√x"; bare "sqrt(3)" and "pi" (not LaTeX commands, not inside a word)
_ROOT_RE = re.compile(r"\u221a\s*(?:\(([^()]*)\)|\{([^{}]*)\}|(\d+(?:\.\d+)?|[a-zA-Z]))")
_BARE_SQRT_RE = re.compile(r"(?<![\\a-zA-Z])sqrt\s*\(([^()]*)\)")
_BARE_PI_RE = re.compile(r"(?<![\\a-zA-Z])pi(?![a-zA-Z])")


class Normalized(NamedTuple):
    """A normalised answer string, whether it was written as a percentage, and whether it carried a degree
    mark."""

    text: str
    percent: bool
    degree: bool = False


def unicode_to_latex(s: str) -> str:
    """Unicode math and bare ``pi`` / ``sqrt(...)`` written as LaTeX: ``"−3π"`` -> ``"-3\\pi "``,
    ``"2√3"`` -> ``"2\\sqrt{3}"``, ``"-2*pi"`` -> ``"-2*\\pi "``, ``"sqrt(2)"`` -> ``"\\sqrt{2}"``.

    Str in, str out; never raises. Source: huggingface/Math-Verify#69 (``-2*pi`` parsed as
    ``-2*p*i``); Unicode minus U+2212 as in PrairieLearn/PrairieLearn#808.
    """
    if s.isascii() and "pi" not in s and "sqrt" not in s:
        return s
    s = _UNICODE_RE.sub(lambda m: _UNICODE[m.group(0)], s)
    s = _ROOT_RE.sub(lambda m: "\\sqrt{" + next(g for g in m.groups() if g is not None) + "}", s)
    s = _BARE_SQRT_RE.sub(lambda m: "\\sqrt{" + m.group(1) + "}", s)
    return _BARE_PI_RE.sub(r"\\pi ", s)


def normalize(answer: str) -> Normalized:
    """Normalise one answer string (gold or prediction) for parsing; see the module docstring.

    Examples: ``"1{,}000{,}000"`` -> ``"1000000"``; ``"5\\text{ cm}^2"`` -> ``"5"``; ``"30^\\circ"`` ->
    ``"30"``; ``"12.5\\%"`` -> ``("12.5", percent=True)``; ``"3.2e-5"`` -> ``"3.2\\times10^{-5}"``;
    ``"2 1/2"`` -> ``"(2+\\frac{1}{2})"``; ``"x \\in [2, 5]"`` -> ``"[2, 5]"``; ``"−2√3"`` -> ``"-2\\sqrt{3}"``.

    Str in, :class:`Normalized` (str ``text``, bool ``percent``, bool ``degree``) out; never raises on
    a str. Source: the
    Minerva / Hendrycks MATH normalisation convention (as in verl's ``math_dapo.normalize_final_answer``), extended
    for issue 13.
    """
    s = unicode_to_latex(answer.strip())
    s = s.replace("\\$", "").replace("$", "")
    s = _STRIP_RE.sub("", s).strip()
    s = _THOUSANDS_RE.sub(lambda m: m.group(1) + _SEP_RE.sub("", m.group(2)), s)
    s = _WRAP_RE.sub(lambda m: m.group(1).strip(), s)
    s, n_degree = _DEGREE_RE.subn("", s)
    s = s.strip()
    percent = False
    m = _PERCENT_RE.search(s)
    if m and m.start() > 0:
        percent, s = True, s[:m.start()].strip()
    s = _UNIT_RE.sub("", s).strip() or s
    if _COMMA_NUMBER_RE.match(s):
        s = s.replace(",", "")
    s = _SCI_RE.sub(lambda m: f"{m.group(1)}\\times10^{{{m.group(2)}}}", s)
    m = _MIXED_RE.match(s)
    if m and int(m.group(3)) < int(m.group(4)):
        s = f"{m.group(1)}({m.group(2)}+\\frac{{{m.group(3)}}}{{{m.group(4)}}})"
    s = _IN_RE.sub("", s)
    return Normalized(s.strip().rstrip(".").strip(), percent, n_degree > 0)
