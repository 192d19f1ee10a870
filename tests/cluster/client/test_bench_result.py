from __future__ import annotations

import json

import pytest

from cluster.client.bench_result import RunMetadata, bench_document, request_columns, strict_json
from cluster.client.bench_summary import BenchSummary, Goodput
from tests.cluster.client.recorded import REPLICAS, record, recorded_run

VLLM_KEYS = {
    "date", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_concurrency", "max_concurrent_requests", "num_prompts",
    *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p90", "p99")
      for m in ("ttft", "tpot", "itl", "e2el")),
}  # fmt: skip
METADATA = {
    "date", "pdserve_version", "backend", "target", "application", "model_id", "seed",
    "request_rate", "max_concurrency", "timeout_s", "workload", "goodput",
}  # fmt: skip


def refuse(constant: str):
    raise ValueError(f"not strict JSON: {constant}")


def strict_loads(text: str) -> dict:
    return json.loads(text, parse_constant=refuse)


def meta(goodput: Goodput | None = None) -> RunMetadata:
    workload = {"kind": "trace", "trace": "mooncake", "skip": 3800, "length_scale": 0.03125}
    return RunMetadata(
        "2026-12-01T00:00:00+00:00", "0.1.0", "pdserve", "127.0.0.1:9000", None, "tiny@0",
        7, None, 4, 600.0, workload, goodput,
    )  # fmt: skip


def test_the_document_has_vllm_keys_and_metadata_and_parses_strictly():
    goodput = Goodput(ttft_ms=150, tpot_ms=200)
    s = BenchSummary.of(recorded_run(), goodput)
    doc = strict_loads(strict_json(bench_document(meta(goodput), s)))
    assert VLLM_KEYS | METADATA <= set(doc)
    assert (doc["completed"], doc["failed"], doc["num_prompts"]) == (3, 1, 4)
    assert doc["total_input_tokens"] == 300 and doc["total_output_tokens"] == 6
    assert doc["duration"] == pytest.approx(1.1)
    assert doc["total_token_throughput"] == pytest.approx(306 / 1.1)
    assert doc["mean_ttft_ms"] == pytest.approx(400 / 3)
    assert doc["median_tpot_ms"] == pytest.approx(200)  # TPOTs 100 and 300 ms
    assert doc["p99_itl_ms"] == pytest.approx(296)  # gaps 100, 100, 300 ms, interpolated
    assert doc["std_e2el_ms"] == pytest.approx(141.42, abs=0.01)  # 400, 400, 100 ms
    assert doc["request_goodput"] == pytest.approx(1 / 1.1)  # only request 3 meets both
    assert doc["goodput"] == {"ttft_ms": 150, "tpot_ms": 200}
    assert doc["workload"]["trace"] == "mooncake" and doc["seed"] == 7
    assert doc["max_concurrency"] == 4 and doc["request_rate"] is None
    assert doc["failures"] == {"RESOURCE_EXHAUSTED": 1}
    assert "input_lens" not in doc  # per-request columns only when asked


def test_a_run_where_nothing_completed_writes_null_not_nan():
    s = BenchSummary.of([record(0, 0.0, [], status="UNAVAILABLE")] * 2)
    text = strict_json(bench_document(meta(), s, []))
    assert "NaN" not in text and "Infinity" not in text
    doc = strict_loads(text)
    assert doc["completed"] == 0 and doc["duration"] is None
    assert doc["mean_ttft_ms"] is None and doc["request_throughput"] is None
    assert doc["dominant_phase"] is None and doc["request_goodput"] is None
    with pytest.raises(ValueError, match="not strict JSON: NaN"):
        strict_loads(json.dumps({"x": float("nan")}))  # the check itself works


def test_detailed_columns_hold_every_request_in_workload_order():
    records = recorded_run()
    doc = strict_loads(strict_json(bench_document(meta(), BenchSummary.of(records), records,
                                                  REPLICAS)))  # fmt: skip
    cols = request_columns(records)
    assert all(len(v) == 4 for v in cols.values())
    assert doc["input_lens"] == [100] * 4 and doc["output_lens"] == [3, 2, 0, 1]
    assert doc["ttfts"] == pytest.approx([0.2, 0.1, None, 0.1])
    assert doc["itls"][0] == pytest.approx([0.1, 0.1]) and doc["itls"][2] == []
    assert doc["errors"] == ["", "", "queue full", ""]
    assert doc["statuses"][2] == "RESOURCE_EXHAUSTED"
    assert doc["tpots"][3] is None and doc["e2els"][1] == pytest.approx(0.4)
    assert doc["timings"][1]["prefill_replica"] == "p2" and doc["timings"][2] is None
    assert doc["timings"][0]["kv_transfer_seconds"] == pytest.approx(0.02)
    assert doc["cached_tokens"] == [32, 0, 0, 0]
    assert doc["replicas_over_time"][1] == {"t_s": 0.6, "replicas": {"prefill": 2, "decode": 1}}


@pytest.mark.parametrize(
    "specs, message",
    [
        (["ttf:100"], "the key must be ttft, tpot or e2el"),
        (["ttft=100"], "the key must be"),
        (["tpot:fast"], "expected KEY:MILLISECONDS"),
        (["e2el:0"], "must be > 0"),
        (["e2el:inf"], "must be > 0"),
    ],
)
def test_goodput_refuses_a_bad_slo(specs, message):
    with pytest.raises(ValueError, match=message):
        Goodput.parse(specs)


def test_goodput_parses_vllms_syntax_and_checks_every_bound():
    g = Goodput.parse(["ttft:150", "e2el:350"])
    assert g == Goodput(ttft_ms=150.0, e2el_ms=350.0)
    r0, r1, _, r3 = recorded_run()
    assert [g.meets(r) for r in (r0, r1, r3)] == [False, False, True]  # TTFT 200; E2E 400
