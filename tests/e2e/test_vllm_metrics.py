"""The running "pd" app speaks vLLM's metrics and logs: Prometheus has vLLM's names (as
`ray_vllm_*`, what Ray's Serve LLM dashboard queries) labelled with the served model's name, each
equal to pdserve's own metric it mirrors, and every engine replica writes vLLM's stats line to
its Serve log."""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.e2e.conftest import PD
from tests.e2e.grpc_calls import greedy_sampling
from tests.ray_fixtures import app_metadata, stub

# vLLM series -> the pdserve series it must equal, summed over the app's replicas.
AGREE = {
    "ray_vllm_generation_tokens_total": "ray_pdserve_generation_tokens_total",
    "ray_vllm_prompt_tokens_total": "ray_pdserve_prompt_tokens_total",
    "ray_vllm_prefix_cache_queries_total": "ray_pdserve_prompt_tokens_total",
    "ray_vllm_prefix_cache_hits_total": "ray_pdserve_cached_prompt_tokens_total",
    "ray_vllm_time_to_first_token_seconds_count": "ray_pdserve_time_to_first_token_seconds_count",
    "ray_vllm_inter_token_latency_seconds_count": "ray_pdserve_inter_token_latency_seconds_count",
    "ray_vllm_e2e_request_latency_seconds_count": "ray_pdserve_e2e_request_latency_seconds_count",
    "ray_vllm_request_prompt_tokens_count": "ray_pdserve_e2e_request_latency_seconds_count",
    "ray_vllm_request_queue_time_seconds_count": "ray_pdserve_queue_time_seconds_count",
    "ray_vllm_request_prefill_time_seconds_count": "ray_pdserve_prefill_time_seconds_count",
    "ray_vllm_request_decode_time_seconds_count": "ray_pdserve_decode_time_seconds_count",
    "ray_vllm_request_inference_time_seconds_count": "ray_pdserve_inference_time_seconds_count",
    "ray_vllm_request_time_per_output_token_seconds_count": (
        "ray_pdserve_request_time_per_output_token_seconds_count"
    ),
    "ray_vllm_request_params_max_tokens_count": "ray_pdserve_request_max_tokens_count",
}
# vLLM gauge -> the pdserve gauge of the same replica it must equal.
GAUGES = {
    "ray_vllm_num_requests_running": "ray_pdserve_running_sequences",
    "ray_vllm_num_requests_waiting": "ray_pdserve_waiting_sequences",
    "ray_vllm_kv_cache_usage_perc": "ray_pdserve_kv_cache_usage",
    "ray_vllm_gpu_cache_usage_perc": "ray_pdserve_kv_cache_usage",
}
EXPORT_INTERVAL_S = 10.0  # how often each Ray process exports its metrics (Ray's default)
FINISHED = "ray_vllm_request_decode_time_seconds_count"  # the router's, one per request
REQUESTS = 6
MAX_TOKENS = 4
SHARED = list(range(40, 72))  # two 16-token blocks every request's prompt starts with


def _samples(metrics_port: int) -> list:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
    return [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("application") == PD
    ]


def _mismatches(samples: list) -> dict[str, tuple[float, float]]:
    """What disagrees now: totals, finish reasons, and each engine replica's gauges."""
    total = _totals(samples)
    bad = {v: (total[v], total[p]) for v, p in AGREE.items() if total[v] != total[p]}
    finished = Counter()
    for s in samples:
        if s.name == "ray_vllm_request_success_total":
            finished[s.labels["finished_reason"]] += s.value
        elif s.name == "ray_pdserve_requests_finished_total":
            finished[s.labels["reason"]] -= s.value
    bad |= {f"finished {r}": (n, 0) for r, n in finished.items() if n}
    gauge = {
        (s.name, s.labels["replica"]): s.value
        for s in samples
        if s.name in {*GAUGES, *GAUGES.values()}
    }
    for v, p in GAUGES.items():
        bad |= {
            f"{v} {r}": (x, gauge.get((p, r)))
            for (n, r), x in gauge.items()
            if n == v and gauge.get((p, r)) != x
        }
    return bad


def _send_requests(apps) -> list[pb.GenerateResponse]:
    """Each request's last message (the one with usage and timing)."""
    s = stub(apps)
    last = []
    for i in range(REQUESTS):
        request = pb.GenerateRequest(
            prompt_token_ids=[*SHARED, 100 + i, 200 + i], sampling=greedy_sampling(MAX_TOKENS)
        )
        last.append(list(s.Generate(request, metadata=app_metadata(PD)))[-1])
    return last


def _totals(samples: list) -> Counter[str]:
    total: Counter[str] = Counter()
    for s in samples:
        total[s.name] += s.value
    return total


def _agreed(apps, finished: float = 0) -> list:
    """The app's samples once every vLLM series equals its pdserve series (Ray exports every
    few seconds, pdserve and vLLM series not necessarily in the same export), and the router
    has recorded at least `finished` requests."""
    deadline = time.monotonic() + 60
    names_needed = {*AGREE, *GAUGES}
    while True:
        samples = _samples(apps.metrics_port)
        bad = _mismatches(samples)
        names = {s.name for s in samples}
        done = _totals(samples)[FINISHED]
        if not bad and names_needed <= names and done >= finished:
            return samples
        assert time.monotonic() < deadline, (bad, sorted(names_needed - names), done, finished)
        time.sleep(1.0)


def test_vllm_names_are_exported_and_agree_with_pdserves(apps, tokenizer_model_dir):
    _send_requests(apps)
    samples = _agreed(apps)
    total = _totals(samples)
    assert total["ray_vllm_request_success_total"] >= REQUESTS
    assert total["ray_vllm_generation_tokens_total"] >= MAX_TOKENS * REQUESTS
    assert total["ray_vllm_prefix_cache_hits_total"] >= len(SHARED)  # the prefix was reused
    # The engine replicas' series carry the served model's name and vLLM's engine label.
    engine = [
        s for s in samples if s.name.startswith("ray_vllm_") and s.labels["deployment"] != "Router"
    ]
    assert {s.labels["deployment"] for s in engine} == {"Prefill", "Decode"}
    assert {(s.labels["model_name"], s.labels["engine"]) for s in engine} == {
        (tokenizer_model_dir.name, "0")
    }


def test_the_routers_vllm_series_carry_the_model_name(apps, tokenizer_model_dir):
    _send_requests(apps)
    routed = [
        s
        for s in _agreed(apps)
        if s.name.startswith("ray_vllm_") and s.labels["deployment"] == "Router"
    ]
    assert routed
    assert {s.labels.get("model_name") for s in routed} == {tokenizer_model_dir.name}


def _settled(apps) -> list:
    """Agreed samples that include every request finished so far: the router's count stayed
    the same for longer than an export interval."""
    samples = _agreed(apps)
    while True:
        time.sleep(EXPORT_INTERVAL_S + 1.0)
        again = _agreed(apps)
        if _totals(again)[FINISHED] == _totals(samples)[FINISHED]:
            return again
        samples = again


def _bucket_counts(samples: list, name: str) -> Counter[float]:
    """A histogram's cumulative bucket counts (by upper bound), summed over replicas."""
    counts: Counter[float] = Counter()
    for s in samples:
        if s.name == f"{name}_bucket":
            counts[float(s.labels["le"])] += s.value
    return counts


def test_per_request_phases_are_recorded_once_each_as_the_requests_timing_says(apps):
    """Each request adds one observation, in the bucket its own Timing puts it in (Ray exports
    a histogram's sum from bucket midpoints, so the buckets are what can be compared)."""
    before = _settled(apps)
    last = _send_requests(apps)
    after = _agreed(apps, finished=_totals(before)[FINISHED] + REQUESTS)
    assert [m.usage.completion_tokens for m in last] == [MAX_TOKENS] * REQUESTS
    t = [m.timing for m in last]
    expected = {
        "request_decode_time_seconds": [x.decode_seconds for x in t],
        "request_inference_time_seconds": [x.prefill_seconds + x.decode_seconds for x in t],
        "request_time_per_output_token_seconds": [x.decode_seconds / (MAX_TOKENS - 1) for x in t],
        "request_params_max_tokens": [MAX_TOKENS] * REQUESTS,
    }
    for name, values in expected.items():
        series = f"ray_vllm_{name}"
        added = _totals(after)[f"{series}_count"] - _totals(before)[f"{series}_count"]
        assert added == REQUESTS, name  # once per request, not per token
        was, now = _bucket_counts(before, series), _bucket_counts(after, series)
        assert now, name
        got = {le: now[le] - was[le] for le in now}
        assert got == {le: sum(v <= le for v in values) for le in now}, name


def _stats_lines(pool: str, deployment: str) -> list[str]:
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"
    lines = []
    for f in logs.glob(f"replica_{PD}_{deployment}_*.log"):
        lines += [ln for ln in f.read_text().splitlines() if f"{pool} engine: Avg prompt" in ln]
    return lines


def test_every_engine_pool_writes_the_stats_line_to_its_serve_log(apps):
    before = {p: len(_stats_lines(p, d)) for p, d in (("prefill", "Prefill"), ("decode", "Decode"))}
    _send_requests(apps)
    deadline = time.monotonic() + 30  # a line every 10 s while busy
    while any(len(_stats_lines(p, p.capitalize())) <= n for p, n in before.items()):
        assert time.monotonic() < deadline, "no stats line after the requests"
        time.sleep(1.0)
    line = _stats_lines("decode", "Decode")[-1]
    assert "INFO" in line and "Running:" in line and "Prefix cache hit rate:" in line
