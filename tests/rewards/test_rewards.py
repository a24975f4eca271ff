"""Rewards: boxed extraction, the JustRL/DAPO string match, math-verify in the pool (gold first), timeouts and
crashes scored 0 and counted, reasoning-gym scoring, and DAPO overlong shaping."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from stapo_jax.config.schema import load_config
from stapo_jax.rewards import RewardScorer, VerifierPool, make_scorer, score, shutdown
from stapo_jax.rewards import gym as rgym
from stapo_jax.rewards.boxed import extract_last_boxed, last_boxed_only_string, remove_boxed
from stapo_jax.rewards.string_match import extract_strict_box, is_correct, normalize_final_answer, score_one

PATHOLOGICAL = "so the answer is \\boxed{9^{9^{9^{9}}}}."  # sympy evaluates the tower: a C-level hang


@pytest.fixture(scope="module")
def mv_scorer():
    with RewardScorer("math_verify_01", timeout_s=2.0, num_workers=2) as s:
        yield s


# ------------------------------------------------------------------------------------------- boxed


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),                                   # last box wins
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                              # nested braces
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                                  # balanced escaped braces stay
    ("\\boxed{}", ""),                                                     # empty box
    ("\\boxed{\\text{(C)}} and more text", "\\text{(C)}"),
    ("no box here", None),
    ("\\boxed 5", None),                                                   # DAPO recognises only \boxed{
    ("\\boxed{12", None),                                                  # unclosed
    ("\\boxed{1} and \\boxed{2", None),                                    # the last \boxed{ is unclosed
    ("\\fbox{3}", None),
    ("\\boxed{a}}}", "a"),
])
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected
    span = last_boxed_only_string(text)
    assert (span is None) == (expected is None)
    if span is not None:
        assert span == "\\boxed{" + expected + "}" and remove_boxed(span) == expected


def test_remove_boxed_rejects_non_box():
    with pytest.raises(ValueError, match="not a"):
        remove_boxed("{42}")


# ------------------------------------------------------------------------------------ string match


def test_strict_box_window_is_last_100_chars():
    tail = "x" * 93
    assert extract_strict_box("\\boxed{7}" + tail[:91]) == "7"            # 9 + 91 = 100 chars: inside
    assert extract_strict_box("\\boxed{7}" + tail[:92]) is None           # starts 101 chars from the end
    long_solution = "\\boxed{1} " + "y" * 500 + " so \\boxed{2}."
    assert extract_strict_box(long_solution) == "2"


def test_string_match_scores():
    assert score_one("Thus \\boxed{18}.", "18") == 1.0
    assert score_one("Thus \\boxed{19}.", "18") == -1.0
    assert score_one("Thus \\boxed{19}.", "18", plus_minus=False) == 0.0
    assert score_one("no box", "18") == -1.0
    # JustRL compares raw strings; the DAPO normalisation is opt-in
    assert is_correct("\\boxed{ 18 }", "18") == (False, " 18 ")
    assert is_correct("\\boxed{ 18 }", "18", normalize=True) == (True, " 18 ")
    assert is_correct("\\boxed{1,000 dollars}", "1000", normalize=True)[0]
    with pytest.raises(TypeError):
        is_correct("\\boxed{1}", 1)


@pytest.mark.parametrize("raw,expected", [
    ("x = 5", "5"),                       # right-hand side of the last '='
    ("1,000", "1000"),                    # thousands separator of an integer
    ("\\text{(C)}", "(C)"),
    ("\\frac12", "\\frac{1}{2}"),         # shorthand TeX
    ("\\sqrt2", "\\sqrt{2}"),
    ("90^\\circ", "90"),
    ("5 \\text{ cm}", "5"),
    ("$\\$18.90$", "18.90"),
    ("\\boxed{7}", "7"),
])
def test_dapo_normalize_final_answer(raw, expected):
    assert normalize_final_answer(raw) == expected


def test_boxed_scorer_kinds_inline():
    responses = ["so \\boxed{3}", "so \\boxed{4}", "nothing"]
    s, st = score(responses, ["3", "3", "3"], "boxed_exact_pm1")
    np.testing.assert_array_equal(s, np.array([1, -1, -1], np.float32))
    assert s.dtype == np.float32 and st["n_correct"] == 1 and st["accuracy"] == pytest.approx(1 / 3)
    s, _ = score(responses, ["3", "3", "3"], "boxed_exact_01")
    np.testing.assert_array_equal(s, np.array([1, 0, 0], np.float32))


# ------------------------------------------------------------------------------------- math-verify


def test_math_verify_equivalences(mv_scorer):
    responses = ["\\boxed{0.5}", "so $x = \\boxed{\\dfrac{1}{2}}$", "\\boxed{\\frac{2}{4}}", "\\boxed{3}",
                 "the answer is \\boxed{(1,2)}", "the answer is \\boxed{1<x<2}", "I give up"]
    golds = ["\\frac{1}{2}", "0.5", "\\frac12", "4", "1<x<2", "(1,2)", "7"]
    s, st = mv_scorer.score(responses, golds)
    # (1,2) vs 1<x<2 is only equal with the relation as gold: the pool passes gold first.
    np.testing.assert_array_equal(s, np.array([1, 1, 1, 0, 1, 0, 0], np.float32))
    assert st["n_timeout"] == 0 and st["n_error"] == 0 and st["n_correct"] == 4


def test_math_verify_timeout_scores_zero_and_is_counted(mv_scorer):
    t0 = time.perf_counter()
    s, st = mv_scorer.score([PATHOLOGICAL, "\\boxed{5}", PATHOLOGICAL + " x"], ["5", "5", "5"])
    assert time.perf_counter() - t0 < 20
    np.testing.assert_array_equal(s, np.array([0, 1, 0], np.float32))
    assert st["n_timeout"] == 2 and st["n_error"] == 0 and st["n_correct"] == 1
    # the killed workers were replaced: the pool still scores
    s, st = mv_scorer.score(["\\boxed{2}"], ["2"])
    assert s[0] == 1.0 and st["n_timeout"] == 0


def test_pool_counts_crashes_and_exceptions():
    with VerifierPool(2) as pool:
        out = pool.run(time.sleep, [(0.05,), (30,)], timeout_s=1.0)
        assert out == [("ok", None), ("timeout", None)]
        died = pool.run(os._exit, [(3,)], timeout_s=5.0)
        assert died[0][0] == "error" and "worker died" in died[0][1]
        raised = pool.run(int, [("not a number",), ("12",)], timeout_s=5.0)
        assert raised[0][0] == "error" and "ValueError" in raised[0][1] and raised[1] == ("ok", 12)
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(int, [("1",)], timeout_s=1.0)


def test_scorer_input_errors(mv_scorer):
    with pytest.raises(ValueError, match="2 responses but 1 golds"):
        mv_scorer.score(["a", "b"], ["1"])
    with pytest.raises(TypeError, match=r"responses\[1\]"):
        mv_scorer.score(["a", None], ["1", "2"])
    with pytest.raises(TypeError, match=r"golds\[0\]"):
        mv_scorer.score(["a"], [1])
    with pytest.raises(ValueError, match="reward kind"):
        RewardScorer("exact")


def test_functional_score_reuses_its_pool():
    s1, _ = score(["\\boxed{1}"], ["1"], "math_verify_01", num_workers=1, timeout_s=5.0)
    from stapo_jax import rewards

    scorers = rewards.active_scorers()
    s2, _ = score(["\\boxed{2}"], ["1"], "math_verify_01", num_workers=1, timeout_s=5.0)
    assert rewards.active_scorers() == scorers and (s1[0], s2[0]) == (1.0, 0.0)
    shutdown()
    assert not rewards.active_scorers()


# --------------------------------------------------------------------------------------------- gym


def test_gym_scoring_with_reasoning_gym():
    entries = rgym.make_entries("chain_sum", 4, seed=3, config=dict(min_terms=2, max_terms=2, min_digits=1,
                                                                    max_digits=1))
    assert entries == rgym.make_entries("chain_sum", 4, seed=3, config=dict(min_terms=2, max_terms=2,
                                                                            min_digits=1, max_digits=1))
    e = entries[0]
    right, wrong = e["answer"], str(int(e["answer"]) + 1)
    assert rgym.score_one(f"so \\boxed{{{right}}}", e, "chain_sum") == 1.0
    assert rgym.score_one(f"so \\boxed{{{wrong}}}", e, "chain_sum") == 0.0
    assert rgym.score_one(f"<answer>{right}</answer>", e, "chain_sum", "answer_tag") == 1.0
    assert rgym.score_one(f"  {right}\n", e, "chain_sum", "raw") == 1.0
    assert rgym.score_one("no answer", e, "chain_sum") == 0.0
    with pytest.raises(ValueError, match="no_such_task"):
        rgym.make_entries("no_such_task", 2, seed=0)


def test_gym_scorer_pool_counts_verifier_crash():
    cfg = load_config(None, ["data.source=gym", "data.gym.task=chain_sum", "reward.kind=gym", "reward.num_workers=1",
                             "reward.timeout_s=10"])
    entries = rgym.make_entries("chain_sum", 3, seed=0)
    with make_scorer(cfg.reward, gym_task=cfg.data.gym.task, extensions=cfg.extensions) as scorer:
        responses = [f"\\boxed{{{e['answer']}}}" for e in entries] + ["\\boxed{1}"]
        s, st = scorer.score(responses, entries + [{"question": "?"}])  # entry without answer: score_answer raises
    np.testing.assert_array_equal(s, np.array([1, 1, 1, 0], np.float32))
    assert st["n_error"] == 1 and st["n_correct"] == 3 and st["n_timeout"] == 0


def test_pool_closed_while_its_workers_start_prints_nothing():
    """A run that fails in setup right after building its reward pool (e.g. a damaged checkpoint) closes the pool
    while the workers are still starting in the forkserver; pebble's stop unlinked the pool's channel locks first,
    so each starting worker died printing a FileNotFoundError traceback (SemLock._rebuild) under the run's one
    error line. Four pools closed at once: stderr stays empty, and close stays fast."""
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from stapo_jax.rewards.pool import VerifierPool\n"
            "if __name__ == '__main__':\n"
            "    t = time.monotonic()\n"
            "    for _ in range(4):\n"
            "        VerifierPool(2, preload=['stapo_jax.rewards.gym']).close()\n"
            "    print(f'{time.monotonic() - t:.1f}')\n")
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    assert float(r.stdout) < 30, r.stdout
