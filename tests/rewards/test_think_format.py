"""The ``think_format`` reward (stapo_jax/rewards/think_format.py) against TRL 1.16's ``think_format_reward`` itself,
and its selection from YAML (``reward.kind: think_format``)."""

from __future__ import annotations

import pytest
from trl.rewards import think_format_reward

from stapo_jax.config.schema import from_dict
from stapo_jax.core.errors import ConfigError
from stapo_jax.rewards import RewardScorer
from stapo_jax.rewards.registry import REWARD_KINDS
from stapo_jax.rewards.think_format import think_format_score

RESPONSES = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
    "<think>\nThis is my reasoning.\nThis is my answer.",  # never closed
    "Answer first <think>then</think> reasoning",  # not at the start
    "<think>a</think><think>b</think> \\boxed{1}",  # a second block
    "<think></think>",
    "<think>\nline one\nline two</think>\n\n\\boxed{42}\n",
    "",
]


def test_think_format_matches_trl():
    theirs = think_format_reward([[{"content": r}] for r in RESPONSES])
    ours = [think_format_score(r, "") for r in RESPONSES]
    assert ours == theirs
    assert ours == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_think_format_scorer_and_yaml():
    assert REWARD_KINDS["think_format"].fn is think_format_score and not REWARD_KINDS["think_format"].pooled
    with RewardScorer("think_format") as scorer:
        scores, stats = scorer.score(RESPONSES[:2], ["7", "7"])
    assert scores.tolist() == [1.0, 0.0] and stats["n_correct"] == 1.0 and stats["n_error"] == 0.0
    assert from_dict({"reward": {"kind": "think_format"}}).reward.kind == "think_format"
    with pytest.raises(ConfigError, match=r"reward.kind: 'think_fromat' is not a registered reward kind; did you mean "
                                          r"'think_format'\?"):
        from_dict({"reward": {"kind": "think_fromat"}})
    with pytest.raises(TypeError, match="response must be str"):
        think_format_score(3, "")
