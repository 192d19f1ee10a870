"""Smoke test of the router path benchmark: a few short streams through each configuration,
the Serve replica's on the session's Serve; the bare servicer's streams are read through both
gRPC servers (grpc.aio and the router's own endpoint) by the same grpc.aio client, which checks
each one's tokens and status.

The benchmark itself checks that every stream got its tokens in order with the right finish
reason (it raises otherwise); this checks the report: each configuration's row with its CPU
figure per message and one per run (/proc counts 10 ms ticks: a run this short may show 0).
The figures need the full load on a quiet machine (benchmarks/results/router_path.md)."""

from __future__ import annotations

import re

from benchmarks import router_path_bench
from tests.benchmarks.bench_report import cells

ROWS = (
    "gRPC alone: grpc.aio",
    "gRPC alone: the router's endpoint",
    "router code, no gRPC",
    "router code behind its gRPC endpoint",
    "the same in a Serve replica, router metrics on",
)
BARE = ROWS[:2]  # no worker double behind these


def test_each_configuration_streams_every_token_and_reports_its_cpu(
    ray_serve, tokenizer_model_dir, tmp_path
):
    out = tmp_path / "router_path.md"
    argv = ["--streams", "4", "--tokens", "20", "--step-ms", "2", "--repeats", "2"]
    argv += ["--in-serve", "--grpc-port", str(ray_serve.grpc_port)]
    argv += ["--model-dir", str(tokenizer_model_dir), "--out", str(out)]
    report = router_path_bench.main(argv)
    assert out.read_text("utf-8") == report
    for label in ROWS:
        median, runs, worker = cells(report, label)
        assert float(median.strip("*")) >= 0, report
        assert len(runs.split(", ")) == 2, report
        if label in BARE:
            assert worker == "-", report
        else:
            assert float(worker) >= 0, report
    assert re.search(r"endpoint costs [\d.]+ µs a message where grpc\.aio costs [\d.]+", report)
    assert re.search(r"the endpoint alone accounts for [\d.]+ \((\d+%|-)\)", report), report
    assert re.search(r"in a Serve replica with the router's metrics on: [\d.]+ µs", report), report
