"""Smoke test of the capacity benchmark: one small N on the session's Ray and Serve, both paths
(each N is the same code; CI time goes to deploying the app and to each run).

It checks that every row of both tables is there with numbers that make sense (every token
delivered, CPU found for each process), not the targets: they need N = 64 on a quiet machine
(the current report is benchmarks/results/capacity.md)."""

from __future__ import annotations

import re

from benchmarks import capacity_bench
from tests.benchmarks.bench_report import cells

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def numbers(cell: str) -> list[float]:
    return [float(m.group().replace(",", "")) for m in _NUMBER.finditer(cell)]


def test_small_run_reports_both_paths_for_each_n(ray_serve, tmp_path):
    out = tmp_path / "capacity.md"
    argv = ["--streams", "3", "--tokens", "12", "--idle-seconds", "0.5", "--stream-interval", "4"]
    argv += ["--repeats", "2"]
    argv += ["--grpc-port", str(ray_serve.grpc_port), "--out", str(out)]
    report = capacity_bench.main(argv)
    assert out.read_text("utf-8") == report
    assert "(no N = 64 run: targets not checked)" in report

    tables = report.split("## Targets")[0]
    titles = re.findall(r"^## ((?:proxy|direct):.*)$", tables, flags=re.M)
    assert [t.endswith("(tokens per message after the first)") for t in titles] == [
        False,
        True,
        False,
        True,
    ], titles
    _, proxy, proxy_4, direct, direct_4 = re.split(r"^## (?:proxy|direct):.*$", tables, flags=re.M)
    for table in (proxy_4, direct_4):  # 12 tokens: 1, then 4, 4 and 3 (or fewer messages)
        assert all(numbers(c)[0] >= 3 for c in cells(table, "tokens per message")), table
    for table in (proxy, direct, proxy_4, direct_4):
        assert cells(table, "streams (N)") == ["3"]
        for label in ("delivered tok/s", "engine alone tok/s", "delivered / engine alone"):
            assert all(numbers(c)[0] > 0 for c in cells(table, label)), label
        # two runs each: the one shown is the lower middle of their ratios, i.e. the lower
        (runs,) = [numbers(c) for c in cells(table, "delivered / engine alone, every run")]
        assert len(runs) == 2 and min(runs) > 0, runs
        assert numbers(cells(table, "delivered / engine alone")[0]) == [min(runs)], table
        per_message = [numbers(c)[0] for c in cells(table, "tokens per message")]
        assert all(1 <= t <= 12 for t in per_message), per_message
        for process in ("Router", "Decode", "client (own process, uvloop)"):
            # /proc counts 10 ms ticks: a short run may show 0, never nothing
            assert all(numbers(c)[0] >= 0 for c in cells(table, f"{process} CPU µs / token"))
        for label in ("TTFT p50 / p99 (ms)", "ITL p50 / p99 (ms)"):
            assert all(len(numbers(c)) == 2 for c in cells(table, label)), label
        # where the wall goes: the ramp served and alone (both past the first token), and the
        # step once every stream decodes (the tail of 12 tokens is enough for one)
        (ramp,) = [
            numbers(c) for c in cells(table, "every stream decoding after (ms), served / alone")
        ]
        ttft_max = numbers(cells(table, "TTFT p50 / p99 (ms)")[0])[1]
        assert ramp[0] >= ttft_max > 0 and ramp[1] > 0, ramp
        (step,) = [
            numbers(c) for c in cells(table, "step once all decode (ms), served ITL p50 / alone")
        ]
        assert len(step) == 2 and all(v > 0 for v in step), step
