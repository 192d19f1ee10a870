"""The fitter recovers known step-time coefficients from synthetic samples: exactly without
noise, within a few percent with it, never a negative coefficient."""

from __future__ import annotations

import random

import pytest

from cluster.planner.step_fit import (
    DecodeSample,
    PrefillSample,
    TransferSample,
    attended_tokens,
    fit_decode,
    fit_prefill,
    fit_transfer,
    nonnegative_least_squares,
    prefill_features,
)

PREFILL = (0.012, 3e-5, 4e-9)  # base, per token, per attended token
DECODE = (0.006, 2e-4, 3e-8)  # base, per sequence, per context token


def prefill_time(prompt: int, cached: int, budget: int) -> float:
    steps, tokens, attended = prefill_features(prompt, cached, budget)
    return PREFILL[0] * steps + PREFILL[1] * tokens + PREFILL[2] * attended


def test_prefill_features_follow_the_chunks_and_keep_the_last_token():
    assert prefill_features(100, 0, 512) == (1, 100, attended_tokens(0, 100))
    assert attended_tokens(0, 3) == 1 + 2 + 3
    assert prefill_features(1200, 0, 512)[0] == 3
    assert prefill_features(64, 64, 512) == (1, 1, 64)  # all cached: the last token computed
    assert prefill_features(100, 32, 512) == (1, 68, attended_tokens(32, 100))


def test_prefill_fit_recovers_the_coefficients():
    samples = [
        PrefillSample(n, c, prefill_time(n, c, 256), 256)
        for n in (16, 100, 300, 700, 1500)
        for c in (0, 64)
        if c < n
    ]
    m = fit_prefill(samples)
    assert (m.base_s, m.per_token_s, m.per_attended_s) == pytest.approx(PREFILL, rel=1e-6)


def test_decode_fit_recovers_the_coefficients_and_tolerates_noise():
    rng = random.Random(3)
    points = [(b, b * ctx) for b in (1, 2, 4, 8, 16) for ctx in (64, 512, 2048)]

    def t(b, c):
        return DECODE[0] + DECODE[1] * b + DECODE[2] * c

    exact = fit_decode([DecodeSample(b, c, t(b, c)) for b, c in points])
    assert (exact.base_s, exact.per_seq_s, exact.per_context_s) == pytest.approx(DECODE, rel=1e-6)
    noisy = fit_decode([DecodeSample(b, c, t(b, c) * rng.uniform(0.98, 1.02)) for b, c in points])
    assert noisy.time(8, 8 * 1024) == pytest.approx(t(8, 8 * 1024), rel=0.03)


def test_transfer_fit_is_fixed_cost_plus_bytes_over_bandwidth():
    kv = fit_transfer([TransferSample(n, 0.002 + n * 1e-6) for n in (16, 256, 1024)], "grpc", 4096)
    assert kv.fixed_s == pytest.approx(0.002)
    assert kv.bandwidth_bytes_per_s == pytest.approx(4096 / 1e-6)
    assert kv.time(512) == pytest.approx(0.002 + 512e-6)


def test_no_coefficient_goes_negative():
    # y falls with x: the unconstrained slope is negative, the constrained fit is a constant
    c = nonnegative_least_squares([(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)], [3.0, 2.0, 1.0])
    assert c[1] == 0.0 and c[0] > 0


def test_too_few_distinct_samples_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        fit_decode([DecodeSample(1, 10, 0.01), DecodeSample(1, 10, 0.011)])
