"""pdserve's metrics, exported through `ray.serve.metrics` (so each carries Serve's deployment,
replica and application tags) to the Ray dashboard and Prometheus (`ray_` prefix there).

Names follow the vocabulary LLM servers share; `pool` says which pool a value belongs to
(router, prefill, decode, colocated). Latencies are histograms in seconds. A `PoolMetrics`
records each observation again under vLLM's names, labelled with the served model's name
(vllm_metrics.py), for dashboards and alerts written for vLLM.
"""

from __future__ import annotations

from asyncio import _get_running_loop
from collections.abc import Callable

from ray.serve.metrics import Counter, Gauge, Histogram

from cluster.serving.metric_recorder import Batched, fan_out, positive, recorder
from cluster.serving.pool_load import GAUGES as LOAD_GAUGES
from cluster.serving.vllm_metrics import VllmMetrics

_LATENCY_BUCKETS = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
]  # fmt: skip
_BYTES_BUCKETS = [2.0**k for k in range(10, 34, 2)]
_TOKEN_BUCKETS = [float(m * 10**e) for e in range(7) for m in (1, 2, 5)]  # 1 .. 5M

# name -> (kind, description, tag keys); every metric also has Serve's own tags.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "pdserve_time_to_first_token_seconds": ("histogram", "Time to first token", ("pool",)),
    "pdserve_inter_token_latency_seconds": ("histogram", "Time between output tokens", ("pool",)),
    "pdserve_e2e_request_latency_seconds": ("histogram", "End-to-end request time", ("pool",)),
    "pdserve_queue_time_seconds": ("histogram", "Time waiting for an engine step", ("pool",)),
    "pdserve_prefill_time_seconds": ("histogram", "Prompt computation time", ("pool",)),
    "pdserve_decode_time_seconds": (
        "histogram",
        "First token to last, once per request",
        ("pool",),
    ),
    "pdserve_inference_time_seconds": (
        "histogram",
        "Prefill time plus decode time, once per request",
        ("pool",),
    ),
    "pdserve_request_time_per_output_token_seconds": (
        "histogram",
        "Decode time over the output tokens after the first, once per request (0 for one token)",
        ("pool",),
    ),
    "pdserve_request_max_tokens": ("histogram", "max_tokens the request asked for", ("pool",)),
    "pdserve_kv_transfer_time_seconds": ("histogram", "KV fetch + import time", ("pool",)),
    "pdserve_kv_transfer_bytes_total": ("counter", "KV bytes moved between pools", ("pool",)),
    "pdserve_kv_transfer_failures_total": ("counter", "Failed KV fetches", ("pool", "code")),
    "pdserve_kv_leases_expired_total": ("counter", "KV leases freed by expiry", ("pool",)),
    "pdserve_kv_leases_released_total": (
        "counter",
        "KV leases ended by a release, by reason: fetched (decode has the KV), cancelled (the "
        "request was cancelled first), aborted (the router gave up on a failed decode hop)",
        ("pool", "reason"),
    ),
    "pdserve_replica_up": (
        "gauge",
        "1 per live engine replica",
        ("pool",),
    ),
    # Every load signal's gauge is declared with the signal (pool_load.py), added below.
    "pdserve_waiting_sequences": ("gauge", "Sequences waiting to be scheduled", ("pool",)),
    "pdserve_prompt_tokens_total": ("counter", "Prompt tokens of served requests", ("pool",)),
    "pdserve_cached_prompt_tokens_total": (
        "counter",
        "Prompt tokens whose KV came from the prefix cache",
        ("pool",),
    ),
    "pdserve_generation_tokens_total": ("counter", "Generated tokens", ("pool",)),
    "pdserve_prefix_routing_total": (
        "counter",
        "Calls a router placed in a prefilling pool, by outcome: cached_prefix (where it had "
        "sent the prompt's start), new_prefix (nowhere had it), spilled (its holders were busy)",
        ("pool", "outcome"),
    ),
    "pdserve_requests_finished_total": ("counter", "Finished requests", ("pool", "reason")),
    "pdserve_request_migrations_total": (
        "counter",
        "Generations resumed on another replica after a replica of `from_pool` failed "
        "mid-stream (decode migration)",
        ("pool", "from_pool"),
    ),
}

METRICS.update({name: ("gauge", help_, ("pool",)) for name, help_ in LOAD_GAUGES.items()})


class PoolMetrics:
    """The metrics one replica records, all tagged with its pool, and each also under the vLLM
    names `vllm_metrics.MIRRORS` maps it to, labelled `model_name` (`served_model_name`; empty
    when not given), and with `kv_transport` "nixl" under `NIXL_MIRRORS`' too. Create inside a
    replica."""

    def __init__(self, pool: str, model_name: str = "", kv_transport: str = "") -> None:
        self.pool = pool
        self._m = {name: _make(name, *spec) for name, spec in METRICS.items()}
        for m in self._m.values():
            m.set_default_tags({"pool": pool})
        self._vllm = VllmMetrics(model_name, kv_transport)
        self._series: dict[tuple, Callable[[float], None]] = {}
        self._recorders: dict[tuple, Batched] = {}

    def observe(self, name: str, value: float, **tags: str) -> None:
        """One value of histogram `name`: batched (`histogram_recorder`) on an event loop,
        recorded at once on any other thread (the engine's and its output thread's)."""
        self._record(name, tags)(value)

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        """Add `value` to counter `name` (0 adds nothing; its histogram mirrors still get
        it), batched on an event loop as `observe` is."""
        self._record(name, tags)(value)

    def set(self, name: str, value: float) -> None:
        self._m[name].set(value)
        self._vllm.mirror_gauge(name, value)

    def histogram_recorder(self, name: str, **tags: str) -> Callable[[float], None]:
        """`observe(name, value, **tags)` (or `inc`, for a counter) as one function of
        `value`, for the event loop that records it: the values are recorded in batches
        (`Batched`: up to `FLUSH_S` later, each one still its own observation) through the
        series' prepared recorders (`_prepared`). The router records per token with it, and
        every replica its per-request values through `observe` and `inc` (Ray's metric calls
        took a share of the router's GIL time in bursts of requests; batched, the router's
        CPU a request went down, the pools' within noise: docs/findings.md)."""
        key = (name, *sorted(tags.items()))
        made = self._recorders.get(key)
        if made is None:
            made = self._recorders[key] = Batched(self._prepared(key, name, tags))
        return made

    def _record(self, name: str, tags: dict[str, str]) -> Callable[[float], None]:
        if _get_running_loop() is not None:
            return self.histogram_recorder(name, **tags)
        return self._prepared((name, *sorted(tags.items())), name, tags)

    def _prepared(self, key: tuple, name: str, tags: dict[str, str]) -> Callable[[float], None]:
        """One function recording a value in histogram or counter `name` with `tags` and in
        each vLLM series it is mirrored under, the tags merged and checked once (not at every
        value, as `Histogram.observe` does); a counter's 0 adds nothing. Made once per key
        (from any thread: at worst made twice)."""
        made = self._series.get(key)
        if made is None:
            own = recorder(self._m[name], tags)
            if isinstance(self._m[name], Counter):
                own = positive(own)
            made = self._series[key] = fan_out([own, *self._vllm.recorders(name, tags)])
        return made

    def flush(self) -> None:
        """Record every value `histogram_recorder`s still hold (at shutdown)."""
        for batched in self._recorders.values():
            batched.flush()


def pool_metric(name: str, pool: str):
    """One of `METRICS` on its own, tagged with `pool`: for a pool's metric that another
    process records (the routers record the prefilling pools' routing outcomes)."""
    metric = _make(name, *METRICS[name])
    metric.set_default_tags({"pool": pool})
    return metric


def _make(name: str, kind: str, description: str, tag_keys: tuple[str, ...]):
    if kind == "histogram":
        if name.endswith("_tokens"):
            buckets = _TOKEN_BUCKETS
        elif name.endswith("_bytes"):
            buckets = _BYTES_BUCKETS
        else:
            buckets = _LATENCY_BUCKETS
        return Histogram(name, description, boundaries=buckets, tag_keys=tag_keys)
    if kind == "counter":
        return Counter(name, description, tag_keys=tag_keys)
    return Gauge(name, description, tag_keys=tag_keys)
