"""vLLM's metric names, recorded beside pdserve's own, so that what was written for vLLM works on
pdserve unchanged: Ray's built-in "Serve LLM" Grafana dashboard, vLLM's example dashboards, alert
rules on `vllm:*`.

Names are vLLM's with the colon made an underscore (`vllm:num_requests_running` ->
`vllm_num_requests_running`), as vLLM's own Ray stat logger (`RayPrometheusStatLogger`) names
them: Ray 2.60 warns on a `:` and its exporter drops such a metric. Prometheus then has them as
`ray_vllm_*`, the names Ray's Serve LLM dashboard queries. Labels are vLLM's: `model_name` (the
served model's name) and `engine` ("0": one engine per replica), `finished_reason` on
`request_success`; Serve adds deployment, replica and application. Types, help texts and bucket
boundaries are vLLM's.

Nothing records these by name: each pdserve observation is recorded again under the vLLM names
`MIRRORS` maps it to (`VllmMetrics.recorders` for histograms and counters, `mirror_gauge`), so
the two never disagree.

With the `nixl` KV transport, the KV transfer figures are also recorded under the names of vLLM's
NixlConnector (`NIXL_MIRRORS`, `vllm:nixl_*`, its buckets): per transfer on the decode side
its time (fetch and import) and bytes, failed fetches; on the prefill side expired leases.
vLLM's `nixl_post_time_seconds`, `nixl_num_descriptors` and `nixl_num_failed_notifications`
have no pdserve equivalent (the READ is not timed apart from its wait, descriptors are counted
only with NIXL telemetry on, and pdserve sends no completion notifications) and are not
exported, rather than exported empty.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ray.serve.metrics import Counter, Gauge, Histogram

from cluster.config import ModelConfig
from cluster.serving.metric_recorder import positive, recorder

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# vLLM's 1-2-5 series up to max_model_len; the router does not know that, so up to 1M tokens.
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 10**6)


@dataclass(frozen=True)
class VllmMetric:
    kind: str  # "gauge", "counter" or "histogram"
    help: str
    buckets: tuple[float, ...] = ()
    tags: tuple[str, ...] = ()  # beyond model_name and engine


_LATENCY_HELP = "Histogram of time spent in {} phase for request."
VLLM_METRICS: dict[str, VllmMetric] = {
    "vllm:num_requests_running": VllmMetric(
        "gauge", "Number of requests in model execution batches."
    ),
    "vllm:num_requests_waiting": VllmMetric("gauge", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": VllmMetric("gauge", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:gpu_cache_usage_perc": VllmMetric(
        "gauge", "KV-cache usage, under vLLM's name before 0.10. 1 means 100 percent usage."
    ),
    "vllm:prompt_tokens_total": VllmMetric("counter", "Number of prefill tokens processed."),
    "vllm:generation_tokens_total": VllmMetric("counter", "Number of generation tokens processed."),
    "vllm:request_success_total": VllmMetric(
        "counter", "Count of successfully processed requests.", tags=("finished_reason",)
    ),
    "vllm:prefix_cache_queries_total": VllmMetric(
        "counter", "Prefix cache queries, in terms of number of queried tokens."
    ),
    "vllm:prefix_cache_hits_total": VllmMetric(
        "counter", "Prefix cache hits, in terms of number of cached tokens."
    ),
    "vllm:request_prompt_tokens": VllmMetric(
        "histogram", "Number of prefill tokens processed.", _TOKEN_BUCKETS
    ),
    "vllm:request_generation_tokens": VllmMetric(
        "histogram", "Number of generation tokens processed.", _TOKEN_BUCKETS
    ),
    "vllm:time_to_first_token_seconds": VllmMetric(
        "histogram", "Histogram of time to first token in seconds.", _TTFT_BUCKETS
    ),
    "vllm:inter_token_latency_seconds": VllmMetric(
        "histogram", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS
    ),
    "vllm:e2e_request_latency_seconds": VllmMetric(
        "histogram", "Histogram of e2e request latency in seconds.", _REQUEST_LATENCY_BUCKETS
    ),
    "vllm:request_queue_time_seconds": VllmMetric(
        "histogram", _LATENCY_HELP.format("WAITING"), _REQUEST_LATENCY_BUCKETS
    ),
    "vllm:request_prefill_time_seconds": VllmMetric(
        "histogram", _LATENCY_HELP.format("PREFILL"), _REQUEST_LATENCY_BUCKETS
    ),
    "vllm:request_decode_time_seconds": VllmMetric(
        "histogram", _LATENCY_HELP.format("DECODE"), _REQUEST_LATENCY_BUCKETS
    ),
    "vllm:request_inference_time_seconds": VllmMetric(
        "histogram", _LATENCY_HELP.format("RUNNING"), _REQUEST_LATENCY_BUCKETS
    ),
    "vllm:request_time_per_output_token_seconds": VllmMetric(
        "histogram", "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS
    ),
    "vllm:request_params_max_tokens": VllmMetric(
        "histogram", "Histogram of the max_tokens request parameter.", _TOKEN_BUCKETS
    ),
}

# vLLM's shared KV-transfer bucket edges: 5 ms to 5 s, 2 KiB to 8 GiB every other power of two.
_XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
_XFER_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
NIXL_METRICS: dict[str, VllmMetric] = {
    "vllm:nixl_xfer_time_seconds": VllmMetric(
        "histogram", "Histogram of transfer duration for NIXL KV Cache transfers.",
        _XFER_TIME_BUCKETS,
    ),
    "vllm:nixl_bytes_transferred": VllmMetric(
        "histogram", "Histogram of bytes transferred per NIXL KV Cache transfers.",
        _XFER_BYTES_BUCKETS,
    ),
    "vllm:nixl_num_failed_transfers_total": VllmMetric(
        "counter", "Number of failed NIXL KV Cache transfers."
    ),
    "vllm:nixl_num_kv_expired_reqs_total": VllmMetric(
        "counter", "Number of requests that had their KV expire. NOTE: This metric is tracked "
        "on the P instance."
    ),
}  # fmt: skip

# pdserve metric -> the vLLM metrics each of its observations is also recorded under.
MIRRORS: dict[str, tuple[str, ...]] = {
    # Engine replicas: their scheduler's figures (`EngineReplica._report`) ...
    "pdserve_running_sequences": ("vllm:num_requests_running",),
    "pdserve_waiting_sequences": ("vllm:num_requests_waiting",),
    "pdserve_kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    # ... and each request's phases on them (the prefill, decode and colocated workers).
    "pdserve_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "pdserve_prefill_time_seconds": ("vllm:request_prefill_time_seconds",),
    # The router: each request as its client sees it (router/tally.py).
    "pdserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # Not `vllm:time_per_output_token_seconds`, the name vLLM deprecated for this one (on no
    # Serve LLM panel): it would cost the router one more observation per streamed token.
    "pdserve_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",),
    "pdserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    # ... and its phases once it had a first token: decode is first token to last, inference
    # the prompt's computation plus decode (vLLM's identity), TPOT decode over the tokens after
    # the first (0 for a single token, as vLLM records it).
    "pdserve_decode_time_seconds": ("vllm:request_decode_time_seconds",),
    "pdserve_inference_time_seconds": ("vllm:request_inference_time_seconds",),
    "pdserve_request_time_per_output_token_seconds": (
        "vllm:request_time_per_output_token_seconds",
    ),
    "pdserve_request_max_tokens": ("vllm:request_params_max_tokens",),
    # The router adds these once per finished request, so each addition is also one
    # observation of that request's prompt or output length.
    "pdserve_prompt_tokens_total": (
        "vllm:prompt_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:request_prompt_tokens",
    ),
    "pdserve_cached_prompt_tokens_total": ("vllm:prefix_cache_hits_total",),
    "pdserve_generation_tokens_total": (
        "vllm:generation_tokens_total",
        "vllm:request_generation_tokens",
    ),
    "pdserve_requests_finished_total": ("vllm:request_success_total",),
}
# ... and with the nixl transport (`VllmMetrics(kv_transport="nixl")`), these too. A bytes
# counter's addition is one transfer's bytes, so one observation of the bytes histogram.
NIXL_MIRRORS: dict[str, tuple[str, ...]] = {
    "pdserve_kv_transfer_time_seconds": ("vllm:nixl_xfer_time_seconds",),
    "pdserve_kv_transfer_bytes_total": ("vllm:nixl_bytes_transferred",),
    "pdserve_kv_transfer_failures_total": ("vllm:nixl_num_failed_transfers_total",),
    "pdserve_kv_leases_expired_total": ("vllm:nixl_num_kv_expired_reqs_total",),
}
_TAG_NAMES = {"reason": "finished_reason"}  # pdserve tag -> vLLM label


def ray_metric_name(vllm_name: str) -> str:
    """The name Ray records `vllm_name` under (Prometheus adds `ray_`): what vLLM's Ray stat
    logger does, every character outside [a-zA-Z0-9_] made an underscore."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", vllm_name)


def served_model_name(model: ModelConfig) -> str:
    """The `model_name` label: the name clients call the model by, `ModelConfig.served_name`
    (as the router's `ServedModel.name`)."""
    return model.served_name


class VllmMetrics:
    """The vLLM-named metrics of one replica, labelled with the served model's name; with
    `kv_transport` "nixl" also the NixlConnector's. Create inside a replica, through
    `PoolMetrics`."""

    def __init__(self, model_name: str, kv_transport: str = "") -> None:
        self.specs = dict(VLLM_METRICS)
        self.mirrors = dict(MIRRORS)
        if kv_transport == "nixl":
            self.specs.update(NIXL_METRICS)
            for name, targets in NIXL_MIRRORS.items():
                self.mirrors[name] = self.mirrors.get(name, ()) + targets
        self._m = {name: _make(name, spec) for name, spec in self.specs.items()}
        for m in self._m.values():
            m.set_default_tags({"model_name": model_name, "engine": "0"})

    def mirror_gauge(self, name: str, value: float) -> None:
        """Set each vLLM gauge that `MIRRORS` maps the pdserve gauge `name` to."""
        for target in self.mirrors.get(name, ()):
            self._m[target].set(value)

    def recorders(self, name: str, tags: dict[str, str]) -> list[Callable[[float], None]]:
        """For the pdserve histogram or counter `name` with `tags`: a function of the value
        for each vLLM histogram or counter `MIRRORS` maps it to, its tags renamed and kept as
        that series has them (a counter's 0 dropped; `metrics.PoolMetrics._prepared`)."""
        renamed = {_TAG_NAMES.get(k, k): v for k, v in tags.items()}
        made = []
        for target in self.mirrors.get(name, ()):
            spec = self.specs[target]
            if spec.kind == "gauge":
                continue
            record = recorder(self._m[target], {k: v for k, v in renamed.items() if k in spec.tags})
            made.append(record if spec.kind == "histogram" else positive(record))
        return made


def _make(name: str, spec: VllmMetric):
    keys = ("model_name", "engine", *spec.tags)
    ray_name = ray_metric_name(name)
    if spec.kind == "histogram":
        return Histogram(ray_name, spec.help, boundaries=list(spec.buckets), tag_keys=keys)
    if spec.kind == "counter":
        return Counter(ray_name, spec.help, tag_keys=keys)
    return Gauge(ray_name, spec.help, tag_keys=keys)
