"""`pdserve bench` and `pdserve phases` against the session's apps: a real local Ray, the real
gRPC proxy and engines."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.cli.main import main
from cluster.client.bench_summary import BenchSummary
from cluster.client.load_generator import run_workload
from cluster.client.workload import Workload, WorkloadRequest, synthetic_workload
from tests.e2e.conftest import CO, PD
from tests.ray_fixtures import wait_for_idle
from tests.traces import SHARED_PREFIX_TRACE, write_trace


def refuse(constant: str):
    raise ValueError(f"not strict JSON: {constant}")


def run_cli(capsys, *args: str) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out, parse_constant=refuse)


def test_bench_replays_a_trace_with_its_shared_prefixes(apps, tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.jsonl", SHARED_PREFIX_TRACE)
    detailed, plots = tmp_path / "run.json", tmp_path / "plots"
    out = run_cli(
        capsys, "bench", "--target", apps.grpc_target, "--application", PD,
        "--trace", str(trace), "--length-scale", str(1 / 32), "--json",
        "--save-detailed", str(detailed), "--plot", str(plots),
    )  # fmt: skip
    assert out["completed"] == out["num_prompts"] == 6 and out["failures"] == {}
    assert out["total_output_tokens"] == sum(m for _, _, m, _ in SHARED_PREFIX_TRACE)
    assert out["total_input_tokens"] == 48 + 48 + 32 + 61 + 32 + 16
    # Requests 2 and 4 could reuse 32 tokens, request 5 16; prefix-affinity routing sends
    # each back to the replica that cached them.
    assert out["reusable_prompt_tokens"] == 32 + 32 + 16
    assert out["cached_prompt_tokens"] == out["reusable_prompt_tokens"]
    assert sum(out["phases_mean_s"].values()) == pytest.approx(out["mean_e2el_ms"] / 1e3)
    assert sum(out["prefill_replicas"].values()) == sum(out["decode_replicas"].values()) == 6
    assert "trace of 6 requests" in out["workload"]["description"]
    assert (out["backend"], out["target"], out["application"]) == ("pdserve", apps.grpc_target, PD)
    assert out["model_id"] and out["date"] and out["pdserve_version"]
    doc = json.loads(detailed.read_text(), parse_constant=refuse)
    assert doc["tpots"].count(None) == 1  # the 1-token answer has no TPOT
    assert sum(map(len, doc["itls"])) == sum(m - 1 for _, _, m, _ in SHARED_PREFIX_TRACE)
    assert all(t["prefill_replica"] for t in doc["timings"])
    assert doc["replicas_over_time"][0]["replicas"]["prefill"] == 2
    assert {"ttft_cdf.png", "itl_cdf.png", "phases.png", "replicas.png"} <= {
        p.name for p in plots.iterdir()
    }
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_bench_over_openai_http_measures_the_same_workload(apps, capsys, tmp_path):
    common = ("--num-requests", "4", "--input-len", "24", "--output-len", "6", "--seed", "3",
              "--json", "--no-progress")  # fmt: skip
    grpc_out = run_cli(capsys, "bench", "--target", apps.grpc_target, "--application", PD,
                       "--vocab-size", "512", *common)  # fmt: skip
    http = f"{apps.http_base}/pd/v1"
    # The same workload under `vllm bench serve`'s flag names, at 2 requests a second.
    vllm_names = ("--num-prompts", "4", "--dataset-name", "random", "--random-input-len", "24",
                  "--random-output-len", "6", "--request-rate", "2", "--seed", "3", "--json",
                  "--no-progress")  # fmt: skip
    http_out = run_cli(capsys, "bench", "--backend", "openai", "--base-url", http, *vllm_names)
    assert http_out["backend"] == "openai" and http_out["target"] == http
    for out in (grpc_out, http_out):
        assert out["completed"] == 4 and out["failed"] == 0
        assert (out["total_input_tokens"], out["total_output_tokens"]) == (96, 24)
        assert out["mean_ttft_ms"] > 0 and out["mean_itl_ms"] > 0
    assert grpc_out["model_id"].startswith(http_out["model_id"])  # "tiny@<hash>", served "tiny"
    # pdserve's `pdserve_timing` on the last chunk gives the phases over HTTP too.
    assert sum(http_out["decode_replicas"].values()) == 4
    chat = run_cli(
        capsys, "bench", "--backend", "openai-chat", "--base-url", http,
        "--num-requests", "2", "--input-len", "16", "--output-len", "4", "--json",
        "--no-progress", "--save-detailed", str(tmp_path / "chat.json"),
    )  # fmt: skip
    detail = json.loads((tmp_path / "chat.json").read_text())["errors"]
    assert chat["completed"] == 2 and chat["total_output_tokens"] == 8, detail
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_a_failed_request_is_counted_and_the_others_are_served(apps):
    good = synthetic_workload(3, 20, 5, vocab_size=1000, seed=11).requests
    bad = WorkloadRequest(0.0, (10**6,), 5)  # a token id past the vocabulary
    records = asyncio.run(
        run_workload(apps.grpc_target, Workload((*good, bad), "mixed"), application=CO)
    )
    s = BenchSummary.of(records)
    assert (s.completed, s.failures) == (3, {"INVALID_ARGUMENT": 1})
    assert records[3].error and records[3].output_tokens == 0
    assert [r.output_tokens for r in records[:3]] == [5, 5, 5]
    # Colocated: no KV moves, one replica does both phases.
    assert s.phase_mean_s["kv_transfer"] == 0.0
    assert all(r.timing.prefill_replica == r.timing.decode_replica for r in records[:3])
    wait_for_idle(apps, CO, {"colocated"})


def test_phases_names_the_dominant_phase_predicted_and_measured(apps, capsys):
    target = ("--target", apps.grpc_target, "--application", PD, "--json")
    outs = {}
    for input_len, output_len, dominant in [(16, 48, "decode"), (1536, 2, "prefill")]:
        out = run_cli(
            capsys, "phases", *target, "--input-len", str(input_len),
            "--output-len", str(output_len), "--num-requests", "2", "--max-concurrency", "1",
        )  # fmt: skip
        assert out["predicted_dominant_phase"] == dominant, out
        assert out["measured"]["dominant_phase"] == dominant, out
        assert out["measured"]["completed"] == 2 and out["measured"]["cached_prompt_tokens"] == 0
        assert out["model"]["decode_per_token_s"] > 0
        outs[dominant] = out["predicted_mean_s"]
    assert outs["prefill"]["prefill"] > outs["decode"]["prefill"]
    assert outs["decode"]["decode"] > outs["prefill"]["decode"]
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_bench_refuses_a_bad_trace_before_sending_anything(apps, tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(SystemExit, match="missing field 'output_length'"):
        main(["bench", "--target", apps.grpc_target, "--application", PD, "--trace", str(trace)])
