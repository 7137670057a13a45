"""The unbiased pass@k estimator against brute-force enumeration of k-subsets, its edge cases,
and the aggregation over problems and seeds."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from sage_train.eval.evaluate import check_ks, mean_pass_at_k, pass_at_k, summarize


def brute_force(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_enumeration_of_all_k_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force(n, c, k), abs=1e-12), (n, c, k)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (10, 0, 1, 0.0),
        (10, 0, 10, 0.0),  # nothing correct: 0 whatever k
        (10, 10, 1, 1.0),
        (10, 10, 10, 1.0),  # all correct: 1 whatever k
        (10, 1, 10, 1.0),
        (10, 3, 10, 1.0),  # k = n: any correct sample is in the one subset
        (10, 3, 1, 0.3),
        (256, 17, 1, 17 / 256),  # pass@1 = c / n
        (10, 3, 8, 1.0),  # n - c < k: every subset holds a correct one
        (4, 1, 2, 0.5),
    ],
)
def test_edge_cases(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def test_large_n_agrees_with_the_binomial_ratio():
    # The product form stays exact where C(n, k) has hundreds of digits.
    for n, c, k in [(256, 5, 128), (1024, 3, 512), (1024, 1000, 16), (512, 1, 256)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)


def test_k_above_n_and_bad_counts_raise():
    with pytest.raises(ValueError, match=r"k must be in \[1, n=4\]"):
        pass_at_k(4, 2, 5)
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 2, 0)
    with pytest.raises(ValueError, match="c must be"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="n must be"):
        pass_at_k(0, 0, 1)
    with pytest.raises(ValueError, match=r"\[8\]"):
        check_ks([1, 2, 8], 4)


def test_pass_at_1_is_the_mean_of_c_over_n_across_problems():
    counts = [(8, 0), (8, 3), (8, 8), (8, 1)]
    assert mean_pass_at_k(counts, 1) == pytest.approx((0 + 3 + 8 + 1) / 32)
    assert mean_pass_at_k(counts, 8) == pytest.approx(3 / 4)


def test_summarize_averages_problems_then_seeds():
    counts_by_seed = {0: [(4, 1), (4, 0)], 1: [(4, 2), (4, 4)], 2: [(4, 0), (4, 0)]}
    summary = summarize(counts_by_seed, [1, 2, 4])
    assert summary[1]["per_seed"] == pytest.approx([1 / 8, 6 / 8, 0.0])
    assert summary[1]["mean"] == pytest.approx(statistics.fmean([1 / 8, 6 / 8, 0.0]))
    assert summary[1]["std"] == pytest.approx(statistics.stdev([1 / 8, 6 / 8, 0.0]))
    assert summary[4]["per_seed"] == pytest.approx([0.5, 1.0, 0.0])
    assert summarize({0: [(4, 1)]}, [2])[2]["std"] == 0.0
