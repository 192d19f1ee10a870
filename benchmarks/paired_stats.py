"""Medians of paired differences, their distribution-free confidence interval, and the verdict
on a target that only a whole interval can give."""

from __future__ import annotations

import math
import statistics

CI_LEVEL = 0.95


def median_ci(xs: list[float], level: float = CI_LEVEL) -> tuple[float, float, float]:
    """Distribution-free confidence interval for the median of `xs`: the order statistics
    x(k) and x(n+1-k) for the largest k whose coverage, 1 - 2 P(Binomial(n, 1/2) < k), is
    still at least `level`. Returns (low, high, coverage); with too few values for `level`
    it is (min, max) and the smaller coverage those have."""
    ys = sorted(xs)
    n = len(ys)
    k, coverage = 1, 1.0 - 2.0 * 0.5**n
    while k + 1 <= n // 2:
        below = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n  # P(B <= k)
        if 1.0 - 2.0 * below < level:
            break
        k, coverage = k + 1, 1.0 - 2.0 * below
    return ys[k - 1], ys[n - k], coverage


def bounded_verdict(low: float, high: float, target: float) -> str:
    """PASS when the whole interval is within the target, FAIL when none of it is, else the
    runs do not tell (the noise of the machine is larger than the distance to the target)."""
    if high <= target:
        return "PASS"
    if low > target:
        return "FAIL"
    return "NOT SHOWN"


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float], scale: float = 1e3) -> str:
    """min–max of `xs` in ms (scaled)."""
    return f"{min(xs) * scale:.2f}–{max(xs) * scale:.2f}"


def ms(xs: list[float]) -> str:
    """The median in ms, or a dash for no values."""
    return f"{med(xs) * 1e3:.2f}" if xs else "–"


def with_ci(diffs: list[float]) -> str:
    """The median of paired differences in ms and its interval."""
    low, high, _ = median_ci(diffs)
    return f"{med(diffs) * 1e3:+.2f} ({low * 1e3:+.2f} to {high * 1e3:+.2f})"
