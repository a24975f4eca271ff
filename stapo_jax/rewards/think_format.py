"""``think_format``: 1 if the response encloses its reasoning in one ``<think>...</think>`` block at the start
(nothing else is checked; the gold answer is not read), else 0 (TRL ``think_format_reward``; open-r1's
``format_reward`` asks for ``<answer>`` tags as well). A format reward is meant to be added to a correctness
reward; alone it trains the format only.
"""
from __future__ import annotations

import re

from stapo_jax.rewards.registry import register_reward

__all__ = ["think_format_score", "THINK_FORMAT"]

# TRL 1.16 trl/rewards/format_rewards.py think_format_reward: the response starts with <think>, has no second
# <think>, and closes the block (re.DOTALL | re.MULTILINE, re.match)
THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


@register_reward("think_format")
def think_format_score(response: str, gold: str) -> float:
    """1.0 if ``response`` matches :data:`THINK_FORMAT` (``<think>`` first, one reasoning block, closed), else 0.0.

    Str response (``gold``, a str, is not read); returns a float. Raises: TypeError when ``response`` is
    not a str. Source: TRL ``trl.rewards.think_format_reward`` (same pattern and flags).
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    return 1.0 if THINK_FORMAT.match(response) else 0.0
