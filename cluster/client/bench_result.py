"""The JSON document of a `pdserve bench` run, in the shape of `vllm bench serve`'s result
file so the same tools read both: the run's metadata (`RunMetadata`: date, pdserve version,
backend, target, model, seed, rate, concurrency, workload and its scales), the metrics
(`BenchSummary.metrics`: `completed`, `request_throughput`, `mean_ttft_ms`, `p99_itl_ms`,
`request_goodput`, ...) and, when detailed, the per-request columns (`input_lens`,
`output_lens`, `ttfts`, `itls`, `errors` as vLLM names them, then pdserve's own).

Strict JSON: a value that is not a finite number (a latency with no samples, a throughput over
no time) is null, never NaN or Infinity.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from cluster.client.bench_summary import BenchSummary, Goodput
from cluster.client.load_generator import PhaseTiming, ReplicaSample, RequestRecord


@dataclass(frozen=True)
class RunMetadata:
    """What was run, against what. `request_rate` is None when requests arrive all at once or
    at a trace's times; `workload` holds the workload's kind, description and parameters (a
    trace's path, window and scales; a synthetic workload's lengths)."""

    date: str  # ISO 8601, UTC
    pdserve_version: str
    backend: str  # "pdserve" (gRPC), "openai" or "openai-chat"
    target: str  # host:port, or the OpenAI base URL
    application: str | None
    model_id: str
    seed: int
    request_rate: float | None
    max_concurrency: int | None
    timeout_s: float
    workload: dict[str, Any]
    goodput: Goodput | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["goodput"] = None if self.goodput is None else self.goodput.to_json()
        return out


def finite(value: Any) -> Any:
    """`value` with every float that is not finite replaced by None, through dicts and lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def strict_json(value: Any, **kwargs: Any) -> str:
    """`json.dumps` that cannot write NaN or Infinity: they become null."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def bench_document(
    meta: RunMetadata,
    summary: BenchSummary,
    records: list[RequestRecord] | None = None,
    replicas: list[ReplicaSample] | None = None,
) -> dict[str, Any]:
    """The run's document: metadata, metrics and, with `records`, the per-request columns
    (and the pools' sizes over time, when sampled)."""
    doc = {**meta.to_json(), **summary.metrics()}
    if records is not None:
        doc.update(request_columns(records))
    if replicas is not None:
        doc["replicas_over_time"] = [{"t_s": s.t_s, "replicas": s.replicas} for s in replicas]
    return doc


def request_columns(records: list[RequestRecord]) -> dict[str, list]:
    """One list per field, one entry per request in workload order; a failed request has
    null latencies, empty `itls` and its error. Times are seconds (`ttfts`, `itls` as in
    vLLM); `start_times` count from the start of the run."""
    ok = [r.ok for r in records]
    return {
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens if k else 0 for r, k in zip(records, ok, strict=True)],
        "ttfts": [r.ttft_s if k else None for r, k in zip(records, ok, strict=True)],
        "itls": [r.itl_s if k else [] for r, k in zip(records, ok, strict=True)],
        "errors": [r.error for r in records],
        "statuses": [r.status for r in records],
        "start_times": [r.sent_s for r in records],
        "e2els": [r.e2e_s if k else None for r, k in zip(records, ok, strict=True)],
        "tpots": [r.tpot_s if k else None for r, k in zip(records, ok, strict=True)],
        "finish_reasons": [r.finish_reason for r in records],
        "cached_tokens": [r.cached_prompt_tokens for r in records],
        "timings": [_timing(r.timing) for r in records],
    }


def _timing(t: PhaseTiming | None) -> dict[str, Any] | None:
    if t is None:
        return None
    out: dict[str, Any] = {f"{k}_seconds": getattr(t, k) for k in PhaseTiming.SECONDS}
    return {**out, "prefill_replica": t.prefill_replica, "decode_replica": t.decode_replica}
