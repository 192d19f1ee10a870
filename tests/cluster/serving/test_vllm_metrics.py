"""pdserve's metrics under vLLM's names: each pdserve observation is recorded again, with the
same value, under the vLLM names it maps to, labelled with the model's name; the names are those
Ray's built-in Serve LLM dashboard queries (no Ray: the metric classes are doubles)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray

from cluster.config import ModelConfig
from cluster.serving import metrics, vllm_metrics
from cluster.serving.metrics import METRICS, PoolMetrics
from cluster.serving.vllm_metrics import (
    MIRRORS,
    VLLM_METRICS,
    ray_metric_name,
    served_model_name,
)

RAY_SERVE_LLM_PANELS = (
    Path(ray.__file__).parent / "dashboard/modules/metrics/dashboards/serve_llm_dashboard_panels.py"
)
# What the Serve LLM dashboard shows that pdserve has, as its panels name them (a histogram's
# base name where a helper adds the suffix): its model and worker pickers (request prompt
# tokens), throughput, latency, cache, scheduler, finish reasons, queue and prefill time.
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
    assert vllm("vllm:time_per_output_token_seconds") == [(0.01, model)]
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
