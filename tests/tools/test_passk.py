"""Unbiased pass@k (Chen et al. 2021, eq. 1) and avg@n against hand-computed values and exact rational
arithmetic (Python's ``math.comb`` + ``fractions.Fraction``, the other side)."""
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stapo_jax.tools.passk import PassKError, avg_at_n, default_ks, mean_pass_at_k, pass_at_k


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k) in exact rationals (math.comb(n-c, k) is 0 when n-c < k)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 0.4),            # c/n
    (5, 2, 2, 0.7),            # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 0.9),            # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),            # n - c = 3 < k: every 4-subset holds a correct sample
    (4, 1, 2, 0.5),            # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (32, 1, 8, 0.25),          # 1 - C(31,8)/C(32,8) = 1 - 24/32
    (10, 0, 5, 0.0),
    (10, 10, 1, 1.0),
    (4, 3, 1, 0.75),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    # C(2000, 1000) ~ 2e600 overflows float64; the product form must still match the exact value.
    n, c, k = 2000, 7, 1000
    with pytest.raises(OverflowError):
        float(math.comb(n, k))
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-12)
    assert pass_at_k(1024, 1, 1) == pytest.approx(1 / 1024, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_exact_fraction(nck):
    n, c, k = nck
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-10, abs=1e-12)


def test_mean_pass_at_k_and_avg_at_n():
    scores = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    counts = scores.sum(1).astype(int)
    assert avg_at_n(scores) == pytest.approx(100 * 6 / 12)
    assert mean_pass_at_k(4, counts, 1) == pytest.approx(avg_at_n(scores))
    # problem 0: 1 - C(2,2)/C(4,2) = 5/6; problem 1: 0; problem 2: 1
    assert mean_pass_at_k(4, counts, 2) == pytest.approx(100 * (5 / 6 + 0 + 1) / 3)
    assert mean_pass_at_k(4, counts, 4) == pytest.approx(100 * 2 / 3)
    assert mean_pass_at_k([4, 2], [1, 1], 1) == pytest.approx(100 * (0.25 + 0.5) / 2)  # per-problem n


def test_default_ks():
    assert default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_ks(4) == [1, 2, 4]
    assert default_ks(6) == [1, 2, 4, 6]
    assert default_ks(1) == [1]


@pytest.mark.parametrize("args,match", [
    ((0, 0, 1), "n=0"), ((4, 5, 1), "c=5"), ((4, -1, 1), "c=-1"), ((4, 1, 5), "k=5"), ((4, 1, 0), "k=0"),
    ((4.0, 1, 1), "n=4.0"), ((4, True, 1), "c=True"),
])
def test_pass_at_k_errors(args, match):
    with pytest.raises(PassKError, match=match):
        pass_at_k(*args)


def test_avg_and_mean_errors():
    with pytest.raises(PassKError, match="shape"):
        avg_at_n(np.zeros((0, 4)))
    with pytest.raises(PassKError, match=r"\[0, 1\]"):
        avg_at_n([[1.5, 0.0]])
    with pytest.raises(PassKError, match="no problems"):
        mean_pass_at_k(4, [], 1)
    with pytest.raises(PassKError, match="2 sample counts for 3"):
        mean_pass_at_k([4, 4], [1, 1, 1], 1)
