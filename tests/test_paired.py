"""ultracomm.tools.paired: the per-round ratios and the sign-test interval of their median."""

from __future__ import annotations

import math
import random

import pytest

from ultracomm.tools.paired import Paired, compare, median_ci, paired_ratios, verdict


def _j_by_definition(n: int, conf: float = 0.95) -> int:
    """The largest j with P(B < j) <= (1 - conf) / 2, B ~ binomial(n, 1/2), by brute force."""
    best = 1
    for j in range(1, (n + 1) // 2 + 1):
        if sum(math.comb(n, i) for i in range(j)) / 2**n <= (1 - conf) / 2:
            best = j
    return best


@pytest.mark.parametrize("n,j", [(6, 1), (10, 2), (20, 6), (30, 10), (50, 18), (100, 40)])
def test_median_ci_order_statistics_are_the_sign_test_table(n, j):
    # the published 95% ranks (e.g. n = 30: the 10th and 21st values) and the definition agree
    assert _j_by_definition(n) == j
    xs = list(range(100, 100 + n))
    random.Random(n).shuffle(xs)
    med, lo, hi = median_ci(xs)
    assert (lo, hi) == (100 + j - 1, 100 + n - j)
    assert med == (100 + (n - 1) / 2)


def test_median_ci_small_samples_fall_back_to_the_range():
    assert median_ci([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="no values"):
        median_ci([])


def test_median_ci_large_n_does_not_overflow():
    med, lo, hi = median_ci([float(i) for i in range(3001)])
    assert med == 1500.0 and lo < 1500.0 < hi and hi - 1500.0 == 1500.0 - lo


def test_verdicts():
    assert verdict(0.90, 0.99) == "faster"
    assert verdict(1.01, 1.20) == "slower"
    assert verdict(0.95, 1.05) == "same"
    assert verdict(1.0, 1.0) == "same"


def test_paired_ratios_pair_rounds_and_reject_mismatches():
    assert paired_ratios([2.0, 3.0], [1.0, 4.0]) == [2.0, 0.75]
    with pytest.raises(ValueError, match="one time per round"):
        paired_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratios([1.0], [0.0])


def test_compare_pools_runs_and_cancels_a_common_drift():
    # the load swings 10x over the rounds; the method is 5% faster in every round: only pairing shows it
    drift = [1.0 + 9.0 * (i % 7) / 6 for i in range(40)]
    base = [d * 2.0 for d in drift]
    mine = [d * 1.9 for d in drift]
    p = compare([(mine[:20], base[:20]), (mine[20:], base[20:])])
    assert len(p.ratios) == 40 and p.verdict == "faster" and p.hi < 1.0
    assert abs(p.median - 0.95) < 1e-12
    # the same times unpaired: the medians alone differ by less than the spread of either method
    assert isinstance(p, Paired)


def test_equal_methods_are_same():
    rng = random.Random(1)
    base = [rng.uniform(1.0, 3.0) for _ in range(60)]
    mine = [b * rng.choice((0.9, 1.1)) for b in base]  # +-10% noise, no bias
    p = compare([(mine, base)])
    assert p.verdict == "same" and p.lo < 1.0 < p.hi
