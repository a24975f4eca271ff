"""The paper's evaluation protocol (stapo_spec §8-9): the six benchmarks, the two decoding settings, the paper's
Table 2, and the value types shared by problem loading, generation and reporting (``stapo_jax.tools.evaluate``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence, Union

__all__ = ["BenchmarkSpec", "BENCHMARKS", "DecodingSetting", "SETTINGS", "COLUMNS", "PAPER_TABLE2", "METHOD_NAMES",
           "EvalDataError", "Problem", "Completion", "Generator", "Grader"]


# ------------------------------------------------------------------------------------------- protocol


@dataclasses.dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark of the paper's Table 2.

    Attributes:
      name: registry key and default file stem in ``eval.data_dir`` (``aime24`` -> ``aime24.jsonl``).
      column: the Table 2 column header.
      n_samples: N of avg@N (stapo_spec §8).
      num_problems: rows of the shipped file (DATA.md).
    """

    name: str
    column: str
    n_samples: int
    num_problems: int

    @property
    def filename(self) -> str:
        """The benchmark's JSONL file name in the benchmark directory (``<name>.jsonl``)."""
        return f"{self.name}.jsonl"


BENCHMARKS: dict[str, BenchmarkSpec] = {b.name: b for b in (
    BenchmarkSpec("aime24", "AIME24", 32, 30),
    BenchmarkSpec("aime25", "AIME25", 32, 30),
    BenchmarkSpec("amc23", "AMC23", 32, 40),
    BenchmarkSpec("math500", "MATH500", 4, 500),
    BenchmarkSpec("minerva_math", "Minerva", 4, 272),
    BenchmarkSpec("olympiadbench", "Olympiad", 4, 675),
)}


@dataclasses.dataclass(frozen=True)
class DecodingSetting:
    """A decoding setting of stapo_spec §8: ``a`` = T 1.0 / top-p 1.0 (training-aligned), ``b`` = T 0.7 /
    top-p 0.9 (the JustRL setting)."""

    name: str
    temperature: float
    top_p: float

    @property
    def label(self) -> str:
        """Human label for tables, e.g. ``"T=0.7, top-p=0.9"``."""
        return f"T={float(self.temperature)}, top-p={float(self.top_p)}"


SETTINGS: dict[str, DecodingSetting] = {"a": DecodingSetting("a", 1.0, 1.0), "b": DecodingSetting("b", 0.7, 0.9)}

COLUMNS = ("AIME24", "AIME25", "AMC23", "MATH500", "Minerva", "Olympiad", "Avg")
# stapo_spec §9 (Table 2, v1-v3; secondary transcription, *unconfirmed*). (model, method) -> setting ->
# the seven columns above. 14B STAPO setting (a): its Avg (64.38) is not the mean of its cells (64.905).
PAPER_TABLE2: dict[tuple[str, str], dict[str, tuple[float, ...]]] = {
    ("1.7B", "grpo"): {"a": (6.88, 4.06, 40.47, 68.60, 32.44, 30.64, 30.52),
                       "b": (10.83, 4.06, 41.17, 67.15, 32.53, 30.64, 31.06)},
    ("1.7B", "entropy20"): {"a": (13.33, 8.44, 46.56, 69.85, 28.03, 35.65, 33.64),
                            "b": (13.85, 7.60, 44.53, 69.10, 29.04, 34.35, 33.08)},
    ("1.7B", "justrl"): {"a": (8.85, 6.25, 45.39, 62.70, 22.61, 29.15, 29.16),
                         "b": (14.58, 10.93, 51.09, 69.75, 28.89, 34.16, 34.90)},
    ("1.7B", "stapo"): {"a": (17.40, 15.42, 55.94, 73.55, 28.22, 38.54, 38.18),
                        "b": (16.04, 14.27, 52.42, 70.30, 29.42, 37.87, 36.72)},
    ("8B", "grpo"): {"a": (31.25, 24.69, 75.23, 88.90, 55.88, 61.50, 56.24),
                     "b": (32.40, 24.17, 74.14, 88.85, 53.58, 58.34, 55.25)},
    ("8B", "entropy20"): {"a": (31.25, 27.50, 79.92, 89.85, 54.78, 62.50, 57.63),
                          "b": (35.10, 27.39, 80.00, 89.85, 54.23, 60.39, 57.83)},
    ("8B", "justrl"): {"a": (25.21, 21.98, 73.52, 84.90, 47.33, 51.26, 50.70),
                       "b": (34.06, 26.04, 81.48, 87.55, 51.03, 56.57, 56.12)},
    ("8B", "stapo"): {"a": (33.44, 28.65, 79.92, 90.40, 57.17, 62.98, 58.76),
                      "b": (39.48, 29.37, 80.23, 91.40, 55.70, 63.32, 59.92)},
    ("14B", "grpo"): {"a": (42.19, 30.31, 81.95, 90.05, 55.15, 64.76, 60.74),
                      "b": (40.52, 32.40, 78.12, 92.00, 57.54, 64.28, 60.81)},
    ("14B", "entropy20"): {"a": (42.08, 34.06, 84.45, 91.65, 51.10, 61.30, 60.77),
                           "b": (51.25, 39.48, 87.73, 92.30, 54.78, 63.95, 64.92)},
    ("14B", "justrl"): {"a": (37.40, 26.56, 81.95, 87.65, 43.84, 57.01, 55.74),
                        "b": (52.08, 38.96, 89.61, 94.25, 58.92, 68.81, 67.11)},
    ("14B", "stapo"): {"a": (46.98, 35.21, 87.11, 92.45, 59.47, 68.21, 64.38),
                       "b": (54.27, 41.67, 90.62, 93.85, 59.93, 71.62, 68.66)},
}
METHOD_NAMES = {"grpo": "GRPO", "entropy20": "20-Entropy", "justrl": "JustRL", "stapo": "STAPO"}


class EvalDataError(ValueError):
    """A benchmark source that cannot be read, or rows without a usable problem/answer (names the file and
    row)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One benchmark item: ``problem`` text and gold ``answer`` (strings); ``index`` is the row number."""

    index: int
    problem: str
    answer: str


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sampled response: ``text`` (special tokens removed), ``num_tokens`` (response tokens, EOS
    included) and ``truncated`` (stopped by the token limit, not by EOS); the last two are None when the
    generator does not know them."""

    text: str
    num_tokens: Optional[int] = None
    truncated: Optional[bool] = None


class Generator(Protocol):
    """``generate(prompts, *, num_samples, setting, max_new_tokens, seed)`` -> for each of the P prompts, a
    list of ``num_samples`` completions (``str`` or :class:`Completion`), in prompt order."""

    def __call__(self, prompts: Sequence[str], *, num_samples: int, setting: DecodingSetting,
                 max_new_tokens: int, seed: int) -> Sequence[Sequence[Union[str, Completion]]]: ...


# (responses, golds) -> scores [N] (0/1 or -1/+1; > 0 is correct), or (scores, stats mapping)
Grader = Callable[[Sequence[str], Sequence[str]], Any]
