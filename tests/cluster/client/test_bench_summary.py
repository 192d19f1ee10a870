from __future__ import annotations

import math

import numpy as np
import pytest

from cluster.client.bench_summary import (
    PHASE_HINTS,
    PHASES,
    BenchSummary,
    Goodput,
    percentile,
    phase_seconds,
)
from cluster.client.load_generator import PhaseTiming, RequestRecord
from cluster.client.phase_model import PROBE_OUTPUT_TOKENS, Curve, PhaseModel


def record(
    i: int,
    sent: float,
    times: list[float],
    timing: PhaseTiming | None = None,
    status: str = "OK",
    prompt: int = 100,
    cached: int = 0,
) -> RequestRecord:
    r = RequestRecord(i, sent, prompt, len(times), sent_s=sent, status=status)
    if status == "OK":
        r.token_times = list(times)
        r.timing = timing
        r.cached_prompt_tokens = cached
    return r


def timing(queue, prefill, ttft, kv, total, pre="p1", dec="d1") -> PhaseTiming:
    return PhaseTiming(queue, prefill, kv, ttft, total - ttft, total, pre, dec)


@pytest.mark.parametrize("p", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy(p):
    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(xs, p) == pytest.approx(np.percentile(xs, p))
    assert math.isnan(percentile([], p))


def test_every_phase_has_a_hint():
    assert set(PHASE_HINTS) == set(PHASES)


def test_phases_split_the_clients_end_to_end():
    # Client: sent at 1.0, tokens at 1.5, 1.6, 1.7 (e2e 0.7 s). Server: total 0.64 s, TTFT
    # 0.44 of which queue 0.1 and prefill 0.3; KV transfer 0.05.
    r = record(0, 1.0, [1.5, 1.6, 1.7], timing(0.1, 0.3, 0.44, 0.05, 0.64))
    p = phase_seconds(r)
    assert list(p) == list(PHASES)
    assert p["proxy"] == pytest.approx(0.06) and p["routing"] == pytest.approx(0.04)
    assert p["decode"] == pytest.approx(0.15)
    assert sum(p.values()) == pytest.approx(r.e2e_s)
    assert r.ttft_s == pytest.approx(0.5) and r.tpot_s == pytest.approx(0.1)
    assert r.itl_s == pytest.approx([0.1, 0.1])


def test_summary_counts_latencies_failures_cache_and_replicas():
    recs = [
        record(0, 0.0, [0.2, 0.3, 0.4], timing(0.0, 0.15, 0.18, 0.02, 0.38), cached=32),
        record(1, 0.5, [0.6, 0.9], timing(0.05, 0.03, 0.09, 0.1, 0.39, "p2", "d1")),
        record(2, 0.5, [], status="RESOURCE_EXHAUSTED"),
        record(3, 1.0, [1.1], timing(0.0, 0.08, 0.09, 0.0, 0.09, "p2", "d1")),
    ]
    recs[0].reusable_tokens = 48
    s = BenchSummary.of(recs, Goodput(ttft_ms=150, tpot_ms=200))
    assert (s.requests, s.completed, s.failures) == (4, 3, {"RESOURCE_EXHAUSTED": 1})
    assert s.duration_s == pytest.approx(1.1)  # first send to last token
    assert s.output_tokens == 6 and s.prompt_tokens == 300
    assert (s.cached_prompt_tokens, s.reusable_tokens) == (32, 48)
    assert s.request_throughput == pytest.approx(3 / 1.1)
    assert s.ttft.n == 3 and s.ttft.mean == pytest.approx((0.2 + 0.1 + 0.1) / 3)
    assert s.tpot.n == 2 and s.tpot.pct[50] == pytest.approx((0.1 + 0.3) / 2)
    assert s.itl.n == 3 and s.e2e.pct[99] == pytest.approx(percentile([0.4, 0.4, 0.1], 99))
    assert s.prefill_replicas == {"p1": 1, "p2": 2} and s.decode_replicas == {"d1": 3}
    # Request 0: TTFT 0.2 > 0.15; request 1: TPOT 0.3 > 0.2; request 3 meets both.
    assert s.slo_met == 1
    assert sum(s.phase_mean_s.values()) == pytest.approx(s.e2e.mean)
    assert s.dominant_phase == max(s.phase_mean_s, key=s.phase_mean_s.get)
    text = "\n".join(s.render())
    assert "3 of 4 completed (failed: RESOURCE_EXHAUSTED 1)" in text
    assert "32 from the prefix cache" in text and "within the SLOs: 1 of 4" in text
    assert f"Dominant phase: **{s.dominant_phase}**" in text
    assert PHASE_HINTS[s.dominant_phase] in text
    assert s.metrics()["failures"] == {"RESOURCE_EXHAUSTED": 1}
    assert s.max_concurrent == 1  # 0-0.4, 0.5-0.9 and 1.0-1.1 s: one at a time


def test_a_run_where_nothing_completed_says_so():
    s = BenchSummary.of([record(0, 0.0, [], status="UNAVAILABLE")] * 2)
    assert s.completed == 0 and s.failures == {"UNAVAILABLE": 2}
    assert s.render() == ["- requests: none of 2 completed (failed: UNAVAILABLE 2)"]


def test_phase_model_recovers_a_cluster_of_known_costs():
    """Probe records made from a known cluster: prefill 5 ms + 0.2 ms/token + 0.2 us/token^2,
    KV 1 ms + 0.01 ms/token, routing 3 ms, proxy 2 ms, decode 4 ms/token."""

    def probe(n_prompt: int, n_out: int) -> RequestRecord:
        prefill = 0.005 + 0.0002 * n_prompt + 2e-7 * n_prompt**2
        kv = 0.001 + 0.00001 * n_prompt
        ttft = prefill + 0.003
        total = ttft + kv + 0.004 * (n_out - 1)
        times = [0.002 + ttft + (kv if k else 0) + 0.004 * k for k in range(n_out)]
        times[-1] = 0.002 + total
        return record(0, 0.0, times, timing(0.0, prefill, ttft, kv, total), prompt=n_prompt)

    probes = [probe(n, PROBE_OUTPUT_TOKENS) for n in (16, 64, 128, 256)] + [probe(16, 32)]
    m = PhaseModel.fit(probes)
    assert m.prefill.coeffs == pytest.approx((0.005, 2e-4, 2e-7), rel=1e-6)
    assert m.kv_transfer.coeffs == pytest.approx((0.001, 1e-5), rel=1e-6)
    assert m.routing_s == pytest.approx(0.003) and m.proxy_s == pytest.approx(0.002)
    assert m.decode_per_token_s == pytest.approx(0.004)
    p = m.predict(100, 11)
    assert p["prefill"] == pytest.approx(0.027) and p["decode"] == pytest.approx(0.04)
    assert m.predict(100, 1)["kv_transfer"] == 0.0  # a one-token answer never moves its KV
    # prefill + KV at 100 tokens: 27 + 2 ms = 7.25 decode steps; 9 outputs take 8 steps.
    assert m.decode_overtakes_at(100) == 9
    assert "5.0 ms + 200 us x n + 0.2 us x n^2" == m.prefill.describe("n")


def test_phase_model_needs_finished_probes_of_both_kinds():
    with pytest.raises(ValueError, match="did not finish"):
        PhaseModel.fit([record(0, 0.0, [], status="UNAVAILABLE")])
    with pytest.raises(ValueError, match="3 or more lengths"):
        Curve.fit([(16, 0.1), (32, 0.2), (16, 0.3)], 2)


def test_curve_fits_keep_every_cost_non_negative():
    # Noisy prefill times whose plain least-squares quadratic has a negative linear term.
    points = [(16, 0.30), (384, 0.40), (768, 1.90), (1536, 7.20), (16, 0.25), (1536, 6.8)]
    plain = np.polyfit([x for x, _ in points], [y for _, y in points], 2)
    assert plain[1] < 0  # the case this guards against
    curve = Curve.fit(points, 2)
    assert all(c >= 0 for c in curve.coeffs), curve
    assert curve.at(1536) == pytest.approx(7.0, rel=0.1)
    assert curve.at(16) == pytest.approx(0.275, abs=0.2)
