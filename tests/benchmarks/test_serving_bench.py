"""Smoke test of the serving benchmark: one small N on the session's Ray and Serve, both paths
and a second stream interval, and the gRPC reference rows (CI time goes to deploying the app,
so every part of the report is checked in this one run).

It checks that each table and target line is there with numbers that make sense (every token
delivered, CPU found for each process), not the targets themselves: those need N = 64 on a
quiet machine (the current report is benchmarks/results/serving.md)."""

from __future__ import annotations

import re

from benchmarks import serving_bench
from tests.benchmarks.bench_report import cells

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def numbers(cell: str) -> list[float]:
    return [float(m.group().replace(",", "")) for m in _NUMBER.finditer(cell)]


def test_small_run_reports_both_paths_targets_and_the_grpc_reference(ray_serve, tmp_path):
    out = tmp_path / "serving.md"
    argv = ["--streams", "1", "--tokens", "12", "--stream-interval", "4", "--repeats", "2"]
    argv += ["--grpc-port", str(ray_serve.grpc_port), "--out", str(out)]
    report = serving_bench.main(argv)
    assert out.read_text("utf-8") == report

    titles = re.findall(r"^## (.*)$", report, flags=re.M)
    assert titles[:4] == [
        "proxy",
        "proxy, stream_interval 4",
        "direct",
        "direct, stream_interval 4",
    ], titles
    tables = re.split(r"^## .*$", report.split("## Targets")[0], flags=re.M)[1:]
    for title, table in zip(titles, tables, strict=False):
        assert cells(table, "streams (N)") == ["1"]
        for label in ("delivered tok/s", "engine alone tok/s", "delivered / engine alone"):
            assert numbers(cells(table, label)[0])[0] > 0, label
        (runs,) = [numbers(c) for c in cells(table, "every run")]
        assert len(runs) == 2 and min(runs) > 0, runs  # the lower middle of two is shown
        assert numbers(cells(table, "delivered / engine alone")[0]) == [min(runs)], table
        per_message = numbers(cells(table, "tokens per message")[0])[0]
        assert (per_message >= 3) if "interval 4" in title else (1 <= per_message <= 12)
        for process in serving_bench.PROCESSES:
            # /proc counts 10 ms ticks: a short run may show 0, never nothing
            assert numbers(cells(table, f"{process} CPU µs / token")[0])[0] >= 0, process
        ttft = numbers(cells(table, "TTFT p50 / p99 (ms)")[0])
        ramp = numbers(cells(table, "all decoding after (ms), served / alone")[0])
        assert len(ttft) == 2 and ramp[0] >= ttft[1] > 0 and ramp[1] > 0, (ttft, ramp)

    # N = 1: the added latency per token of each path at one token a message, with its interval
    added = re.findall(r"^- (proxy|direct), N = 1: serving adds [-+][\d.]+ ms per token .*"
                       r"\*\*(PASS|FAIL|NOT SHOWN)\*\*$", report, flags=re.M)  # fmt: skip
    assert [path for path, _ in added] == ["proxy", "direct"], report
    reference = report.split("## gRPC alone")[1]
    for server in ("grpc.aio (reference)", "the router's own endpoint"):
        median, every = cells(reference, server)
        assert float(median) > 0 and len(every.split(", ")) == 2, reference
    assert re.search(r"endpoint below grpc\.aio per message: \*\*(PASS|FAIL)\*\*", reference)
