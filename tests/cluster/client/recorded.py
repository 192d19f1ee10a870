"""A recorded `pdserve bench` run for the report, JSON and plot tests: four requests as the
load generator records them (one failed, one with a one-token answer), and pool sizes."""

from __future__ import annotations

from cluster.client.load_generator import PhaseTiming, ReplicaSample, RequestRecord


def timing(queue, prefill, ttft, kv, total, pre="p1", dec="d1") -> PhaseTiming:
    return PhaseTiming(queue, prefill, kv, ttft, total - ttft, total, pre, dec)


def record(i, sent, times, t=None, status="OK", prompt=100, cached=0) -> RequestRecord:
    r = RequestRecord(i, sent, prompt, len(times), sent_s=sent, status=status)
    if status == "OK":
        r.token_times, r.timing, r.cached_prompt_tokens = list(times), t, cached
    else:
        r.error = "queue full"
    return r


def recorded_run() -> list[RequestRecord]:
    return [
        record(0, 0.0, [0.2, 0.3, 0.4], timing(0.0, 0.15, 0.18, 0.02, 0.38), cached=32),
        record(1, 0.5, [0.6, 0.9], timing(0.05, 0.03, 0.09, 0.1, 0.39, "p2", "d1")),
        record(2, 0.5, [], status="RESOURCE_EXHAUSTED"),
        record(3, 1.0, [1.1], timing(0.0, 0.08, 0.09, 0.0, 0.09, "p2", "d1")),
    ]


REPLICAS = [
    ReplicaSample(0.0, {"prefill": 1, "decode": 1}),
    ReplicaSample(0.6, {"prefill": 2, "decode": 1}),
]
