"""The confidence interval of a median of paired differences, and the verdict it gives."""

from __future__ import annotations

import pytest

from benchmarks.report import bounded_verdict, median_ci


def test_the_median_interval_is_the_binomial_order_statistics() -> None:
    xs = [0.5, -1.0, 3.0, 2.0, 1.0, 0.0, 4.0, 6.0, 5.0]  # sorted: -1, 0, 0.5, 1, 2, 3, 4, 5, 6
    low, high, coverage = median_ci(xs)
    # n = 9: P(B <= 1) = 10/512, so x(2)..x(8) covers 1 - 20/512 = 96.1% (x(3)..x(7): 82%)
    assert (low, high) == (0.0, 5.0)
    assert coverage == pytest.approx(1 - 20 / 512)
    assert median_ci([3.0, 1.0]) == (1.0, 3.0, 0.5)  # too few: min..max
    low, high, coverage = median_ci([float(i) for i in range(25)])
    assert (low, high) == (7.0, 17.0) and coverage >= 0.95


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [(-0.5e-3, 0.9e-3, "PASS"), (1.1e-3, 3e-3, "FAIL"), (0.2e-3, 2e-3, "NOT SHOWN")],
)
def test_an_interval_straddling_the_target_is_not_called_either_way(low, high, verdict) -> None:
    assert bounded_verdict(low, high, 1e-3) == verdict
