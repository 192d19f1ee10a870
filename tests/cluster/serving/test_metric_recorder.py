"""`metric_recorder.recorder` records exactly what `Histogram.observe` records (the same value
and merged tags reach Ray's recording call), and refuses missing tags as `observe` does."""

from __future__ import annotations

import asyncio

import pytest
from ray.serve.metrics import Histogram

from cluster.serving.metric_recorder import Batched, fan_out, recorder
from cluster.serving.metrics import PoolMetrics


class Spy:
    """Stands for Ray's recording object behind a histogram: keeps what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, dict]] = []

    def record(self, value, tags=None) -> None:
        self.calls.append((value, dict(tags)))


def _histogram(name: str) -> tuple[Histogram, Spy]:
    h = Histogram(name, "test", boundaries=[0.1, 1.0], tag_keys=("pool", "reason"))
    h.set_default_tags({"pool": "router"})
    spy = Spy()
    h._metric = spy
    return h, spy


def test_recorder_records_what_observe_records():
    h, spy = _histogram("pdserve_test_recorder_same")
    h.observe(0.25, tags={"reason": "stop"})
    recorder(h, {"reason": "stop"})(0.25)
    assert spy.calls[0] == spy.calls[1] == (0.25, {"pool": "router", "reason": "stop"})


def test_recorder_refuses_a_missing_tag_when_made():
    h, _ = _histogram("pdserve_test_recorder_missing")
    with pytest.raises(ValueError, match="reason"):
        recorder(h, {})


def test_fan_out_records_with_each():
    (a, spy_a), (b, spy_b) = _histogram("pdserve_test_fan_a"), _histogram("pdserve_test_fan_b")
    record = fan_out([recorder(a, {"reason": "x"}), recorder(b, {"reason": "y"})])
    record(1.5)
    assert spy_a.calls == [(1.5, {"pool": "router", "reason": "x"})]
    assert spy_b.calls == [(1.5, {"pool": "router", "reason": "y"})]


def test_pool_metrics_recorder_reaches_the_pdserve_series_and_its_vllm_mirrors():
    metrics = PoolMetrics("router", "my-model")
    name = "pdserve_inter_token_latency_seconds"
    spies = {name: Spy()}
    metrics._m[name]._metric = spies[name]
    for target, metric in metrics._vllm._m.items():
        spies[target] = Spy()
        metric._metric = spies[target]
    record = metrics.histogram_recorder(name)
    assert metrics.histogram_recorder(name) is record  # made once per series and tags
    record(0.01)
    record(0.02)
    got = {n: s.calls for n, s in spies.items() if s.calls}
    assert [v for v, _ in got.pop(name)] == [0.01, 0.02]
    assert set(got) == {"vllm:inter_token_latency_seconds"}
    for calls in got.values():
        assert [v for v, _ in calls] == [0.01, 0.02]
        assert all(tags["model_name"] == "my-model" for _, tags in calls)


def test_batched_values_are_all_recorded_in_order_once_the_batch_is_due():
    """On a running loop nothing reaches Ray's call at once; `flush_s` later every value
    does, each its own observation, in order; the next value starts a new batch. Outside a
    loop a value is recorded at once."""
    h, spy = _histogram("pdserve_test_batched")
    record = Batched(recorder(h, {"reason": "x"}), flush_s=0.05)

    async def go() -> None:
        for v in (0.1, 0.2, 0.2):
            record(v)
        assert spy.calls == []
        await asyncio.sleep(0.2)
        assert [v for v, _ in spy.calls] == [0.1, 0.2, 0.2]
        record(0.3)
        assert len(spy.calls) == 3
        await asyncio.sleep(0.2)
        assert [v for v, _ in spy.calls] == [0.1, 0.2, 0.2, 0.3]

    asyncio.run(go())
    record(0.4)
    assert [v for v, _ in spy.calls][-1] == 0.4 and not record.values


def test_pool_metrics_flush_records_what_its_recorders_still_hold():
    """At shutdown (`Orchestrator.close`) no batched value is lost."""
    metrics = PoolMetrics("router", "my-model")
    name = "pdserve_inter_token_latency_seconds"
    spy = Spy()
    metrics._m[name]._metric = spy

    async def go() -> None:
        record = metrics.histogram_recorder(name)
        record(0.5)
        record(0.25)
        assert spy.calls == []
        metrics.flush()
        assert [v for v, _ in spy.calls] == [0.5, 0.25]

    asyncio.run(go())


def _spied(metrics: PoolMetrics) -> dict[str, Spy]:
    spies = {}
    for name, metric in [*metrics._m.items(), *metrics._vllm._m.items()]:
        spies[name] = Spy()
        metric._metric = spies[name]
    return spies


def test_per_request_values_are_batched_on_a_loop_and_recorded_at_once_elsewhere():
    """`observe` and `inc` on an event loop (the replicas' per-request metrics) go through
    the batched recorders: nothing at once, every value at the flush, each vLLM mirror too; a
    counter's 0 adds nothing to the counters but is still a histogram mirror's value. On a
    thread with no loop (the engine thread's) they are recorded at once."""
    metrics = PoolMetrics("decode", "my-model")
    spies = _spied(metrics)

    async def go() -> None:
        metrics.observe("pdserve_queue_time_seconds", 0.5)
        metrics.inc("pdserve_generation_tokens_total", 7)
        metrics.inc("pdserve_generation_tokens_total", 0)
        metrics.inc("pdserve_requests_finished_total", reason="stop")
        assert not any(s.calls for s in spies.values())
        metrics.flush()

    asyncio.run(go())
    got = {n: [v for v, _ in s.calls] for n, s in spies.items() if s.calls}
    assert got == {
        "pdserve_queue_time_seconds": [0.5],
        "vllm:request_queue_time_seconds": [0.5],
        "pdserve_generation_tokens_total": [7],
        "vllm:generation_tokens_total": [7],
        "vllm:request_generation_tokens": [7, 0],
        "pdserve_requests_finished_total": [1.0],
        "vllm:request_success_total": [1.0],
    }
    assert spies["vllm:request_success_total"].calls[0][1]["finished_reason"] == "stop"

    for s in spies.values():
        s.calls.clear()
    metrics.observe("pdserve_queue_time_seconds", 0.25)  # no loop here: at once
    metrics.inc("pdserve_generation_tokens_total", 3)
    got = {n: [v for v, _ in s.calls] for n, s in spies.items() if s.calls}
    assert got["pdserve_queue_time_seconds"] == [0.25]
    assert got["pdserve_generation_tokens_total"] == [3]
    assert got["vllm:request_generation_tokens"] == [3]
