"""reasoning-gym tasks: prompt datasets and scoring with the task's own ``score_answer``.

A task (e.g. ``basic_arithmetic``, ``chain_sum``) is a seeded procedural dataset
(``reasoning_gym.create_dataset(task, size=..., seed=..., **config)``); each entry is a dict
``{"question": str, "answer": str, "metadata": dict}``. Scoring extracts the answer from the response
(``answer_format``: last ``\\boxed{}`` content, reasoning-gym's ``<answer>...</answer>`` tag, or the raw
stripped response) and calls ``reasoning_gym.get_score_answer_fn(task)(answer, entry)``; the result is
reasoning-gym's float in [0, 1] (1.0 = correct; some tasks give partial credit).
"""
from __future__ import annotations

import functools
from typing import Any, Literal, Optional

from stapo_jax.rewards.boxed import extract_last_boxed
from stapo_jax.rewards.registry import register_reward

AnswerFormat = Literal["boxed", "answer_tag", "raw"]


def make_entries(task: str, size: int, seed: int, config: Optional[dict[str, Any]] = None) -> list[dict[str, Any]]:
    """The ``size`` entries of reasoning-gym task ``task`` for ``seed`` (deterministic).

    Raises:
      ValueError: unknown task name or a config reasoning-gym rejects (message names the task).

    ``task`` a str, ``size`` / ``seed`` ints, ``config`` a dict; returns ``size`` dict entries
    (``question`` str, ``answer`` str, ``metadata`` dict). Source: ``reasoning_gym.create_dataset``.
    """
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **(config or {}))
    except Exception as e:  # reasoning-gym raises ValueError/AssertionError/TypeError for bad names/configs
        raise ValueError(f"reasoning-gym task {task!r} (size={size}, seed={seed}, config={config}): {e}") from e
    return [dict(ds[i]) for i in range(len(ds))]


def train_val_entries(task: str, size: int, seed: int, config: Optional[dict[str, Any]], val_size: int,
                      val_seed: Optional[int] = None) -> tuple[list[dict], list[dict], int]:
    """Training entries and a held-out split whose questions do not occur in the training split.

    Returns:
      ``(train, val, n_overlap_dropped)``: ``val`` is drawn with ``val_seed`` and has at most ``val_size``
      entries; questions also in ``train`` are dropped and counted. reasoning-gym seeds item ``i`` with
      ``seed + i``, so the default ``val_seed = seed + size`` continues the training stream without reusing
      one of its seeds (``seed + 1`` would reproduce ``train[1:]``).

    Entries are dicts of str / dict fields; ``n_overlap_dropped`` an int. Raises ValueError (from
    :func:`make_entries`) for an unknown task or a rejected config.
    """
    train = make_entries(task, size, seed, config)
    if val_size <= 0:
        return train, [], 0
    seen = {e["question"] for e in train}
    cand = make_entries(task, val_size, seed + size if val_seed is None else val_seed, config)
    val = [e for e in cand if e["question"] not in seen]
    return train, val, len(cand) - len(val)


def extract_answer(response: str, answer_format: AnswerFormat = "boxed") -> Optional[str]:
    """The answer string the task is scored on, or None if the response has none in that format.

    Str in, str or None out. Source: reasoning-gym's ``utils.extract_answer`` (``answer_tag``) and verl
    ``math_dapo`` box extraction (``boxed``).
    Raises:
      ValueError: ``answer_format`` is not ``boxed``, ``answer_tag`` or ``raw``.
    """
    if answer_format == "boxed":
        ans = extract_last_boxed(response)
        return None if ans is None else ans.strip()
    if answer_format == "answer_tag":
        from reasoning_gym.utils import extract_answer as rg_extract

        return rg_extract(response, tag_name="answer", strip=True)
    if answer_format == "raw":
        return response.strip()
    raise ValueError(f"answer_format={answer_format!r}: expected boxed, answer_tag or raw")


@functools.lru_cache(maxsize=None)
def _score_fn(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


@register_reward("gym", gold_type=dict, pooled=True, options={"task": "gym_task", "answer_format": "gym_answer_format"},
                 requires=("gym_task",))
def score_one(response: str, entry: dict[str, Any], task: str, answer_format: AnswerFormat = "boxed") -> float:
    """reasoning-gym's score of ``response`` for ``entry`` of ``task`` (float in [0, 1]).

    Raises:
      TypeError: ``response`` is not a str or ``entry`` not a dict.
      ValueError: unknown task.
    """
    if not isinstance(response, str) or not isinstance(entry, dict):
        raise TypeError(f"response must be str and entry dict, got {type(response).__name__}, {type(entry).__name__}")
    return float(_score_fn(task)(extract_answer(response, answer_format), entry))


def init_worker() -> None:
    """Pool-worker initializer: import reasoning-gym once.

    Returns None; raises ImportError if reasoning-gym is not installed. Source: reasoning-gym.
    """
    import reasoning_gym  # noqa: F401
