"""DAPO / JustRL string-match verifier (stapo_spec §2 and §13 of §10: ``reward.kind: boxed_exact_pm1``).

Follows ``compute_score(..., strict_box_verify=True)`` of verl's ``utils/reward_score/math_dapo.py`` as used
by the JustRL training code (thunlp/JustRL ``train/verl/utils/reward_score/math_dapo.py``):

1. keep the last 300 characters of the response;
2. of those, keep the last 100 and take the content of the last ``\\boxed{...}`` in them (brace-matched,
   :mod:`stapo_jax.rewards.boxed`);
3. correct iff that content equals the gold answer string exactly.

JustRL compares raw strings. ``normalize=True`` first applies DAPO's ``normalize_final_answer`` (the
Minerva/Hendrycks normalisation: units and ``\\text{}`` removed, ``\\fracab`` -> ``\\frac{a}{b}``, thousands
separators dropped from integers, ...) to both sides. The reward is +1/-1 (JustRL) or 1/0.
"""
from __future__ import annotations

import re
from typing import Optional

from stapo_jax.rewards.boxed import extract_last_boxed
from stapo_jax.rewards.registry import register_reward

RESPONSE_WINDOW = 300  # DAPO: "The longest answer in MATH-500 has 159 characters"
BOX_WINDOW = 100       # strict-box verify: the box must lie in the final 100 characters

# DAPO's normalize_final_answer tables (verl math_dapo.py, from lm-evaluation-harness hendrycks_math).
_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
            ",\\!", "{,}", '"', "\\dots")
_REGEX_REWRITES = ((r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$"), (r"(\\text\{)(.*?)(\})", "\\2"),
                   (r"(\\textbf\{)(.*?)(\})", "\\2"), (r"(\\overline\{)(.*?)(\})", "\\2"),
                   (r"(\\boxed\{)(.*)(\})", "\\2"), (r"(frac)([^{])(.)", "frac{\\2}{\\3}"),
                   (r"(sqrt)([^{])", "sqrt{\\2}"))


def normalize_final_answer(answer: str) -> str:
    """DAPO's answer normalisation (verl ``math_dapo.normalize_final_answer``), e.g. ``"x = 1,000"`` ->
    ``"1000"``, ``"\\text{(C)}"`` -> ``"(C)"``, ``"\\fraca b"`` -> ``"\\frac{a}{b}"``.

    Str in, str out; never raises on a str.
    """
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expr in _REMOVED:
        answer = answer.replace(expr, "")
    for pattern, repl in _REGEX_REWRITES:
        answer = re.sub(pattern, repl, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def extract_strict_box(response: str) -> Optional[str]:
    """The answer JustRL's strict-box verifier reads: content of the last ``\\boxed{}`` within the final
    100 characters (of the final 300) of ``response``; None when there is none.

    Str in, str or None out; never raises.
    """
    return extract_last_boxed(response[-RESPONSE_WINDOW:][-BOX_WINDOW:])


def is_correct(response: str, gold: str, normalize: bool = False) -> tuple[bool, Optional[str]]:
    """Strict-box exact match. Returns ``(correct, extracted_prediction_or_None)``.

    Raises:
      TypeError: ``response`` or ``gold`` is not a str.

    Str in; returns ``(bool, str or None)``. Source: JustRL / verl ``math_dapo.compute_score``
    (``strict_box_verify=True``).
    """
    if not isinstance(response, str) or not isinstance(gold, str):
        raise TypeError(f"response and gold must be str, got {type(response).__name__}, {type(gold).__name__}")
    pred = extract_strict_box(response)
    if pred is None:
        return False, None
    if normalize:
        return normalize_final_answer(pred) == normalize_final_answer(gold), pred
    return pred == gold, pred


@register_reward("boxed_exact_pm1", fixed={"plus_minus": True}, options={"normalize": "boxed_normalize"})
@register_reward("boxed_exact_01", fixed={"plus_minus": False}, options={"normalize": "boxed_normalize"})
def score_one(response: str, gold: str, normalize: bool = False, plus_minus: bool = True) -> float:
    """Reward of one response: +1 correct / -1 wrong (``plus_minus``, JustRL) or 1 / 0.

    Str response and gold, bool flags; returns a float (+1 / -1 or 1 / 0). Raises TypeError (from
    :func:`is_correct`) when ``response`` or ``gold`` is not a str. Source: JustRL's ±1 reward (verl
    ``math_dapo.compute_score``).
    """
    correct, _ = is_correct(response, gold, normalize)
    return 1.0 if correct else (-1.0 if plus_minus else 0.0)
