"""Brace-matched extraction of the last ``\\boxed{...}`` in a text (shared by every verifier).

Semantics follow verl's ``utils/reward_score/math_dapo.py`` (``last_boxed_only_string`` / ``remove_boxed``,
used by DAPO and JustRL): search for the last occurrence of the literal ``\\boxed{``, then scan forward
counting every ``{`` and ``}`` character (escaped ``\\{``/``\\}`` included, so balanced escaped braces stay
inside) until the brace opened by ``\\boxed{`` closes. An unclosed box yields None. Only the ``\\boxed{``
spelling is recognised (no ``\\boxed 5``, no ``\\fbox``), as in DAPO.
"""
from __future__ import annotations

from typing import Optional

BOXED_OPEN = "\\boxed{"


def last_boxed_only_string(text: str) -> Optional[str]:
    """The last ``\\boxed{...}`` span of ``text`` including the command and braces, or None.

    Args:
      text: any string (model output).
    Returns:
      e.g. ``"\\boxed{\\frac{1}{2}}"`` for ``"so x = \\boxed{\\frac{1}{2}}."``; None when there is no
      ``\\boxed{`` or its brace is never closed.

    Str in, str or None out; never raises. Source: verl ``utils/reward_score/math_dapo.py``
    ``last_boxed_only_string``.
    """
    start = text.rfind(BOXED_OPEN)
    if start < 0:
        return None
    end = closing_brace(text, start + len(BOXED_OPEN) - 1)
    return text[start:end + 1] if end >= 0 else None


def closing_brace(text: str, open_pos: int) -> int:
    """Index of the ``}`` that closes the ``{`` at ``open_pos`` of ``text`` (nesting counted; escaped braces
    count too, as in DAPO's ``last_boxed_only_string``); -1 when it never closes.

    ``text`` a str, ``open_pos`` an int index; returns an int index (-1 = unclosed); never raises.
    Source: the brace counting of verl ``math_dapo.last_boxed_only_string``.
    """
    depth = 0
    for i in range(open_pos, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def remove_boxed(span: str) -> str:
    """Strip ``\\boxed{`` and the final ``}`` from a span returned by :func:`last_boxed_only_string`.

    Raises:
      ValueError: ``span`` is not of the form ``\\boxed{...}``.

    Str in, str out. Source: verl ``utils/reward_score/math_dapo.py`` ``remove_boxed``.
    """
    if not (span.startswith(BOXED_OPEN) and span.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} span: {span[:80]!r}")
    return span[len(BOXED_OPEN):-1]


def extract_last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` in ``text`` (may be the empty string), or None if there is none.

    Str in, str or None out; never raises (the span it strips is well formed by construction). Source:
    verl ``math_dapo`` ``remove_boxed(last_boxed_only_string(text))``.
    """
    span = last_boxed_only_string(text)
    return None if span is None else remove_boxed(span)
