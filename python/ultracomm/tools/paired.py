"""Paired comparison of two methods timed round-robin (``ultracomm.tools.bench --interleave``).

On a shared machine the time of one iteration swings with the load of that moment, by more
than two methods differ (perf/README.md section 6b: p2p_gloo's own runs of one row differ by
1.35x at the median).  Iterations of an interleaved run are *rounds*: every method ran once,
back to back, so the ratio of two methods' times in the same round cancels most of that load.
The verdict on a row is taken from those per-round ratios: their median and a distribution-free
95% confidence interval of the median (order statistics of the binomial(n, 1/2) -- the sign
test's interval, no assumption about the shape of the noise).

* ``faster``: the whole interval is below 1;
* ``slower``: the whole interval is above 1;
* ``same``: the interval holds 1 -- no difference this many rounds can show.
"""

from __future__ import annotations

import statistics
from typing import Sequence
from ..errors import InputError

__all__ = ["paired_ratios", "median_ci", "verdict", "Paired", "compare"]


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` per round; both lists are one method's times in round order."""
    if len(a) != len(b):
        raise InputError(
            f"ultracomm: paired times need one time per round for both methods; got {len(a)} and "
            f"{len(b)} (were they timed in the same interleaved run?)"
        )
    if any(not (x > 0) for x in b):
        raise InputError("ultracomm: a paired ratio needs positive times")
    return [float(x) / float(y) for x, y in zip(a, b)]


def median_ci(values: Sequence[float], conf: float = 0.95) -> tuple[float, float, float]:
    """``(median, lo, hi)``: the median of ``values`` and the order-statistic interval
    ``[x_(j), x_(n-j+1)]`` (1-based, sorted) with the largest ``j`` such that
    ``P(B < j) <= (1 - conf) / 2``; it covers the median with probability at least ``conf``
    whatever the distribution.  Fewer than 6 values cannot give a 95% interval: then
    ``lo``/``hi`` are the minimum and maximum (coverage ``1 - 2 / 2**n``)."""
    xs = sorted(float(v) for v in values)
    n = len(xs)
    if n == 0:
        raise InputError("ultracomm: no values to take a median of")
    # j grows while P(B <= j) <= tail, i.e. P(B < j + 1): cumulative binomial counts, exact integers
    tail, whole = (1.0 - conf) / 2.0, 1 << n
    j, term, cum = 1, n, 1 + n  # term = C(n, j), cum = sum of C(n, i) for i <= j
    while j + 1 <= (n + 1) // 2 and cum / whole <= tail:  # int / int: exact for any n
        j += 1
        term = term * (n - j + 1) // j
        cum += term
    return statistics.median(xs), xs[j - 1], xs[n - j]


def verdict(lo: float, hi: float) -> str:
    """``faster`` / ``slower`` / ``same`` of an interval of ratios (method / baseline)."""
    if hi < 1.0:
        return "faster"
    if lo > 1.0:
        return "slower"
    return "same"


class Paired:
    """One comparison: per-round ratios and what they say."""

    def __init__(self, ratios: Sequence[float], conf: float = 0.95):
        self.ratios = list(ratios)
        self.median, self.lo, self.hi = median_ci(self.ratios, conf)
        self.verdict = verdict(self.lo, self.hi)

    def __repr__(self) -> str:
        return (
            f"Paired(n={len(self.ratios)}, median={self.median:.3f}, ci=[{self.lo:.3f}, {self.hi:.3f}], {self.verdict})"
        )


def compare(runs: Sequence[tuple[Sequence[float], Sequence[float]]], conf: float = 0.95) -> Paired:
    """The per-round ratios of several interleaved runs pooled: ``runs`` holds, per run, the
    method's and the baseline's times in round order."""
    ratios: list[float] = []
    for a, b in runs:
        ratios += paired_ratios(a, b)
    return Paired(ratios, conf)
