"""Smoke test of the serving benchmark: `--quick` on the session's Ray and Serve (tiny model).

It checks that every row of the report is there with a positive number, not the targets: a
2-core test machine says nothing about them (the current report is
benchmarks/results/serving.md).
"""

from __future__ import annotations

import re

import pytest

from benchmarks import serving_bench
from benchmarks.serving_config import LABELS, app_config, parse_args
from benchmarks.serving_report import ROWS, cores
from tests.benchmarks.bench_report import cells

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _positive(cell: str) -> float:
    m = _NUMBER.search(cell)
    assert m is not None, f"no number in {cell!r}"
    return float(m.group())


def test_quick_run_reports_every_row_with_positive_numbers(ray_serve, tmp_path):
    out = tmp_path / "report.md"
    argv = ["--quick", "--grpc-port", str(ray_serve.grpc_port), "--out", str(out)]
    report = serving_bench.main(argv)
    assert out.read_text("utf-8") == report

    labels = LABELS.values()
    absolute = [f"decode per token, {label}, via Serve + gRPC" for label in labels]
    alone = [f"decode per token, {label}: its replica's engine alone" for label in labels]
    for label in (*absolute, *alone, *ROWS):
        assert _positive(cells(report, label)[0]) > 0, label
    for label in labels:  # differences: any sign
        _positive(cells(report, f"added per token, {label}")[0])
        _positive(cells(report, f"added per token, {label}, vs its replica's engine alone")[0])
        _positive(
            cells(report, f"this process's engine − the {label} replica's engine, both alone")[0]
        )
        # the decoding engine thread, from its schedstat (this session's Ray is ours)
        served = cells(report, f"{label}, served")
        assert _positive(served[0]) > 0 and _positive(served[1]) >= 0, served
        assert _positive(cells(report, f"{label}, its engine alone")[0]) > 0

    # CPU per token by process: served, with the serving path idle, and what serving cost
    # (/proc counts 10 ms ticks: a short run's router or proxy may show 0)
    for process in ("Router", "proxy", "Decode"):
        served, idle, cost = cells(report, process)[:3]
        assert _positive(served) >= 0 and _positive(idle) >= 0, (process, served, idle)
        _positive(cost)
    assert _positive(cells(report, "Decode")[0]) > 0

    _, cfg = parse_args(["--quick"])
    for n_tok in cfg.long_prompts:
        mb, ms, gbs = (_positive(c) for c in cells(report, str(n_tok))[:3])
        assert mb > 0 and ms > 0 and gbs > 0
        ttft_row = [c for c in report.splitlines() if c.startswith(f"| {n_tok} |")][1]
        values = [_positive(c) for c in ttft_row.strip("|").split("|")[1:]]
        assert len(values) == 7 and all(v > 0 for v in values), ttft_row

    verdicts = ("| PASS |", "| FAIL |", "| NOT SHOWN |")
    targets = [line for line in report.splitlines() if line.endswith(verdicts)]
    # per mode: two direct comparisons and the engine thread's own accounting
    assert len(targets) == 2 * 3 + 2 * len(cfg.long_prompts), targets
    assert "serving's cost to the disaggregated engine thread" in report
    assert "load average before" in report and "torch thread(s)" in report
    assert "- commit: " in report and "- machine: " in report
    # The session's Ray was started as `pdserve serve` starts one: its proxy has NODE_ENV_VARS.
    assert "proxy to router: over gRPC to the router's replica" in report


def test_engine_cpus_reach_the_engine_pools_and_need_a_ray_of_its_own(capsys) -> None:
    _, cfg = parse_args(["--quick", "--engine-cpus", "1"])
    app = app_config(cfg)
    assert (app.prefill.engine_cpus, app.decode.engine_cpus, app.router.engine_cpus) == (
        (1,),
        (1,),
        (),
    )
    assert "engine threads" in cores(cfg)
    for bad in (["--engine-cpus", "x"], ["--engine-cpus", "1", "--grpc-port", "9000"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert "engine" in capsys.readouterr().err


def test_the_report_goes_to_its_one_current_file_by_default() -> None:
    args, _ = parse_args(["--quick"])
    assert args.out.endswith("benchmarks/results/serving.md")
