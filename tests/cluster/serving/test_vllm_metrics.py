"""pdserve's metrics under vLLM's names: each pdserve observation is recorded again, with the
same value, under the vLLM names it maps to, labelled with the model's name; the names are those
Ray's built-in Serve LLM dashboard queries (no Ray: the metric classes are doubles)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray

from cluster.config import ModelConfig
from cluster.request import Request, StepOutput
from cluster.sampling_params import SamplingParams
from cluster.serving import metrics, vllm_metrics
from cluster.serving.metrics import METRICS, PoolMetrics
from cluster.serving.pool_messages import WorkerChunk
from cluster.serving.vllm_metrics import (
    MIRRORS,
    NIXL_METRICS,
    NIXL_MIRRORS,
    VLLM_METRICS,
    ray_metric_name,
    served_model_name,
)
from router import tally

RAY_SERVE_LLM_PANELS = (
    Path(ray.__file__).parent / "dashboard/modules/metrics/dashboards/serve_llm_dashboard_panels.py"
)
# What the Serve LLM dashboard shows that pdserve has, as its panels name them (a histogram's
# base name where a helper adds the suffix): its model and worker pickers (request prompt
# tokens), throughput, latency, cache, scheduler, finish reasons, queue, prefill and decode time,
# per-request TPOT.
DASHBOARD_NAMES = {
    "ray_vllm_request_prompt_tokens_sum",
    "ray_vllm_generation_tokens_total",
    "ray_vllm_prompt_tokens_total",
    "ray_vllm_time_to_first_token_seconds",
    "ray_vllm_e2e_request_latency_seconds",
    "ray_vllm_kv_cache_usage_perc",
    "ray_vllm_prefix_cache_hits_total",
    "ray_vllm_prefix_cache_queries_total",
    "ray_vllm_num_requests_running",
    "ray_vllm_num_requests_waiting",
    "ray_vllm_request_success_total",
    "ray_vllm_request_queue_time_seconds_sum",
    "ray_vllm_request_prefill_time_seconds_sum",
    "ray_vllm_request_decode_time_seconds_sum",
    "ray_vllm_request_time_per_output_token_seconds",
    "ray_vllm_request_generation_tokens",
}


class _Metric:
    """Records what a `ray.serve.metrics` metric would, tags merged over the defaults."""

    made: dict[str, _Metric] = {}

    def __init__(self, name, description="", boundaries=None, tag_keys=()) -> None:
        self.name, self.tag_keys, self.boundaries = name, tag_keys, boundaries
        self.defaults: dict[str, str] = {}
        self.records: list[tuple[float, dict[str, str]]] = []
        _Metric.made[name] = self

    def set_default_tags(self, tags: dict[str, str]) -> None:
        assert set(tags) <= set(self.tag_keys)
        self.defaults = tags

    def _record(self, value: float, tags: dict[str, str] | None = None) -> None:
        merged = {**self.defaults, **(tags or {})}
        assert set(merged) == set(self.tag_keys), (self.name, merged)
        self.records.append((value, merged))

    observe = inc = set = _record


@pytest.fixture
def made(monkeypatch) -> dict[str, _Metric]:
    _Metric.made = {}
    for module in (metrics, vllm_metrics):
        for cls in ("Counter", "Gauge", "Histogram"):
            monkeypatch.setattr(module, cls, _Metric)
    return _Metric.made


def exported_series() -> set[str]:
    """The Prometheus series the vLLM names become (`ray_` prefix; a histogram's series and
    its base name)."""
    names = set()
    for name, spec in VLLM_METRICS.items():
        base = f"ray_{ray_metric_name(name)}"
        suffixes = ("", "_bucket", "_sum", "_count") if spec.kind == "histogram" else ("",)
        names |= {base + s for s in suffixes}
    return names


def test_every_vllm_name_mirrors_a_pdserve_metric():
    targets = {t for ts in MIRRORS.values() for t in ts}
    assert set(MIRRORS) <= set(METRICS)
    assert targets == set(VLLM_METRICS), "a vLLM name that nothing records, or an unknown one"
    for name, spec in VLLM_METRICS.items():
        assert name.startswith("vllm:") and (spec.kind == "counter") == name.endswith("_total")


def test_ray_names_replace_the_colon_as_vllms_ray_logger_does():
    assert ray_metric_name("vllm:num_requests_running") == "vllm_num_requests_running"
    assert all(re.fullmatch(r"vllm_[a-z0-9_]+", ray_metric_name(n)) for n in VLLM_METRICS)


def test_ray_serve_llm_dashboard_queries_these_names():
    queried = set(re.findall(r"ray_vllm_[a-z0-9_]+", RAY_SERVE_LLM_PANELS.read_text()))
    assert DASHBOARD_NAMES <= queried, sorted(DASHBOARD_NAMES - queried)
    assert DASHBOARD_NAMES <= exported_series(), sorted(DASHBOARD_NAMES - exported_series())


def test_the_model_name_label_is_the_served_name():
    assert served_model_name(ModelConfig(path="/models/tiny-v1")) == "tiny-v1"


def test_a_finished_request_is_recorded_under_both_names(made):
    m = PoolMetrics("router", "tiny-v1")
    # What the router's Tally records for a request of 12 prompt tokens, none cached, and 5
    # output tokens that ended on a stop.
    m.observe("pdserve_time_to_first_token_seconds", 0.2)
    m.observe("pdserve_inter_token_latency_seconds", 0.01)
    m.observe("pdserve_e2e_request_latency_seconds", 0.5)
    m.inc("pdserve_prompt_tokens_total", 12)
    m.inc("pdserve_cached_prompt_tokens_total", 0)
    m.inc("pdserve_generation_tokens_total", 5)
    m.inc("pdserve_requests_finished_total", reason="stop")
    model = {"model_name": "tiny-v1", "engine": "0"}

    def vllm(name: str) -> list[tuple[float, dict[str, str]]]:
        return made[ray_metric_name(name)].records

    assert vllm("vllm:time_to_first_token_seconds") == [(0.2, model)]
    assert vllm("vllm:inter_token_latency_seconds") == [(0.01, model)]
    assert ray_metric_name("vllm:time_per_output_token_seconds") not in made  # deprecated
    assert vllm("vllm:e2e_request_latency_seconds") == [(0.5, model)]
    for name in ("prompt_tokens_total", "prefix_cache_queries_total", "request_prompt_tokens"):
        assert vllm(f"vllm:{name}") == [(12, model)], name
    assert vllm("vllm:prefix_cache_hits_total") == []  # Ray refuses a counter's 0
    assert vllm("vllm:generation_tokens_total") == vllm("vllm:request_generation_tokens")
    assert vllm("vllm:request_success_total") == [(1.0, {**model, "finished_reason": "stop"})]
    # pdserve's own keep their pool tag and names.
    assert made["pdserve_generation_tokens_total"].records == [(5, {"pool": "router"})]
    assert made["pdserve_requests_finished_total"].records == [
        (1.0, {"pool": "router", "reason": "stop"})
    ]


def test_engine_figures_and_phases_are_recorded_under_both_names(made):
    m = PoolMetrics("decode", "tiny-v1")
    m.set("pdserve_kv_cache_usage", 0.25)
    m.set("pdserve_running_sequences", 3)
    m.observe("pdserve_queue_time_seconds", 0.004)
    m.inc("pdserve_kv_transfer_bytes_total", 4096)  # no vLLM counterpart
    m.inc("pdserve_generation_tokens_total", 0)  # a request that ended before any token
    model = {"model_name": "tiny-v1", "engine": "0"}
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert made[ray_metric_name(name)].records == [(0.25, model)]
    assert made["vllm_num_requests_running"].records == [(3, model)]
    assert made["vllm_request_queue_time_seconds"].records == [(0.004, model)]
    assert made["vllm_request_generation_tokens"].records == [(0, model)]
    assert made["vllm_generation_tokens_total"].records == []
    vllm_records = [r for name, x in made.items() if name.startswith("vllm_") for r in x.records]
    assert len(vllm_records) == 5


def test_the_router_records_each_requests_phases_once_at_its_finish(made, monkeypatch):
    # A request arrives at t=1.0; its first token (after 0.1 s queued, 0.3 s of prefill) reaches
    # the router at 1.5, two more at 1.6 and the last, at its max_tokens, at 2.0.
    clock = iter([1.5, 1.6, 2.0])
    monkeypatch.setattr(tally, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    request = Request("r1", tuple(range(12)), SamplingParams(max_tokens=4))
    t = tally.Tally(request, 1.0, PoolMetrics("router", "tiny-v1"))
    t.add(WorkerChunk(StepOutput("r1", (5,), "a"), "p0", queue_seconds=0.1, prefill_seconds=0.3))
    t.add(WorkerChunk(StepOutput("r1", (6, 7), "bc"), "d0"))
    last = t.add(WorkerChunk(StepOutput("r1", (8,), "d", "length"), "d0"))
    model = {"model_name": "tiny-v1", "engine": "0"}

    def vllm(name: str) -> list[float]:
        records = made[ray_metric_name(f"vllm:{name}")].records
        assert all(tags == model for _, tags in records), name
        return [value for value, _ in records]

    assert len(vllm("inter_token_latency_seconds")) == 3  # one per token after the first
    # The rest once per request, the decode time as the request's Timing says.
    assert vllm("request_decode_time_seconds") == pytest.approx([last.timing.decode_seconds])
    assert vllm("request_decode_time_seconds") == pytest.approx([0.5])
    assert vllm("request_inference_time_seconds") == pytest.approx([0.3 + 0.5])
    assert vllm("request_time_per_output_token_seconds") == pytest.approx([0.5 / 3])
    assert vllm("request_params_max_tokens") == [4]
    assert vllm("e2e_request_latency_seconds") == pytest.approx([1.0])
    assert vllm("request_prompt_tokens") == [12]
    assert vllm("request_generation_tokens") == [4]
    for name in ("decode_time_seconds", "request_time_per_output_token_seconds"):
        assert len(made[f"pdserve_{name}"].records) == 1, name


def test_a_single_token_requests_tpot_is_zero_as_vllm_records_it(made, monkeypatch):
    clock = iter([1.5])
    monkeypatch.setattr(tally, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    t = tally.Tally(Request("r1", (1, 2), SamplingParams(max_tokens=1)), 1.0, PoolMetrics("router"))
    t.add(WorkerChunk(StepOutput("r1", (5,), "a", "length"), "p0", prefill_seconds=0.2))
    assert made["vllm_request_time_per_output_token_seconds"].records[0][0] == 0.0
    assert made["vllm_request_decode_time_seconds"].records[0][0] == 0.0
    assert made["vllm_request_inference_time_seconds"].records[0][0] == pytest.approx(0.2)


def test_nixl_transfers_are_also_recorded_under_the_nixl_connectors_names(made):
    decode = PoolMetrics("decode", "tiny-v1", kv_transport="nixl")
    decode.observe("pdserve_kv_transfer_time_seconds", 0.02)
    decode.inc("pdserve_kv_transfer_bytes_total", 4096)  # one transfer's bytes
    decode.inc("pdserve_kv_transfer_failures_total", code="UNAVAILABLE")
    model = {"model_name": "tiny-v1", "engine": "0"}
    assert made["vllm_nixl_xfer_time_seconds"].records == [(0.02, model)]
    assert made["vllm_nixl_bytes_transferred"].records == [(4096, model)]
    assert made["vllm_nixl_num_failed_transfers_total"].records == [(1.0, model)]
    assert made["vllm_nixl_bytes_transferred"].boundaries[0] == 2048  # vLLM's buckets
    prefill = PoolMetrics("prefill", "tiny-v1", kv_transport="nixl")  # makes them again
    prefill.inc("pdserve_kv_leases_expired_total", 2)
    assert made["vllm_nixl_num_kv_expired_reqs_total"].records == [(2, model)]
    for name, spec in NIXL_METRICS.items():
        assert (spec.kind == "counter") == name.endswith("_total")  # as Prometheus shows vLLM's
    assert {t for ts in NIXL_MIRRORS.values() for t in ts} == set(NIXL_METRICS)


@pytest.mark.parametrize("transport", ["", "grpc", "gloo"])
def test_other_transports_record_no_nixl_names(made, transport):
    m = PoolMetrics("decode", "tiny-v1", kv_transport=transport)
    m.observe("pdserve_kv_transfer_time_seconds", 0.02)
    m.inc("pdserve_kv_transfer_bytes_total", 4096)
    assert not [name for name in made if name.startswith("vllm_nixl")]
