"""pass@k (the unbiased estimator of Chen et al. 2021), mean@n and greedy accuracy against hand computations."""

import itertools
import math

import pytest

from meshrl.evaluation import greedy_accuracy, pass_at_k, summarize


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)
    assert pass_at_k(4, 0, 2) == 0.0  # nothing correct
    assert pass_at_k(4, 4, 3) == 1.0  # everything correct
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k = 3: every draw of 3 holds a correct one
    assert pass_at_k(5, 5, 5) == 1.0 and pass_at_k(5, 4, 5) == 1.0 and pass_at_k(5, 0, 5) == 0.0
    for n in (1, 3, 8, 16):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # pass@1 = fraction correct


def test_pass_at_k_is_the_exact_binomial_ratio_and_a_draw_probability():
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    # Its meaning: the chance that a random k-subset of the n samples holds a correct one.
    samples = [True, False, True, False, False, False]
    subsets = list(itertools.combinations(samples, 3))
    assert pass_at_k(6, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_pass_at_k_is_stable_for_large_n():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5)
    assert 0.0 <= pass_at_k(1024, 3, 100) <= 1.0


def test_pass_at_k_rejects_impossible_arguments():
    with pytest.raises(ValueError, match="k=6 with n=5"):
        pass_at_k(5, 1, 6)
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(5, 1, 0)
    with pytest.raises(ValueError, match="c=6 correct out of n=5"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="n=0"):
        pass_at_k(0, 0, 1)


def test_summarize_by_hand():
    correct = [
        [True, False, False, False],  # c=1
        [True, True, False, False],  # c=2
        [False, False, False, False],  # c=0
    ]
    out = summarize(correct, ks=[1, 2, 4, 8])
    assert list(out) == ["mean@4", "pass@1", "pass@2", "pass@4"]  # pass@8 needs 8 samples: left out
    assert out["mean@4"] == pytest.approx(3 / 12)
    assert out["pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    # pass@2: c=1 -> 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5; c=2 -> 1 - C(2,2)/C(4,2) = 1 - 1/6; c=0 -> 0
    assert out["pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert out["pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert summarize([[1, 0], [0, 0]], ks=[1]) == {"mean@2": 0.25, "pass@1": 0.25}  # 0/1 count as bools
    assert summarize([[True]], ks=(1, 1)) == {"mean@1": 1.0, "pass@1": 1.0}


def test_summarize_rejects_ragged_or_empty_tables():
    with pytest.raises(ValueError, match="problem 1 has 3 samples, problem 0 has 2"):
        summarize([[True, False], [True, True, True]], ks=[1])
    with pytest.raises(ValueError, match="no problems"):
        summarize([], ks=[1])
    with pytest.raises(ValueError, match="no samples"):
        summarize([[]], ks=[1])
    with pytest.raises(ValueError, match="k=0"):
        summarize([[True]], ks=[0])


def test_greedy_accuracy():
    assert greedy_accuracy([True, False, True, True]) == 0.75
    with pytest.raises(ValueError, match="no problems"):
        greedy_accuracy([])
