"""Smoke test of the serving benchmark: `--quick` on the session's Ray and Serve (tiny model).

It checks that every row of the report is there with a positive number, not the targets: a
2-core test machine says nothing about them (the full run's report is in
cluster/benchmarks/results/).
"""

from __future__ import annotations

import re

from cluster.benchmarks import serving_bench

_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _cells(report: str, label: str) -> list[str]:
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in the report:\n{report}")


def _positive(cell: str) -> float:
    m = _NUMBER.search(cell)
    assert m is not None, f"no number in {cell!r}"
    return float(m.group())


def test_quick_run_reports_every_row_with_positive_numbers(ray_serve):
    report = serving_bench.main(["--quick", "--grpc-port", str(ray_serve.grpc_port)])

    labels = serving_bench.LABELS.values()
    absolute = [f"decode per token, {label}, via Serve + gRPC" for label in labels]
    for label in (*absolute, *serving_bench.ROWS):
        assert _positive(_cells(report, label)[0]) > 0, label
    for label in labels:  # a difference: any sign
        _positive(_cells(report, f"added per token, {label}")[0])

    _, cfg = serving_bench.parse_args(["--quick"])
    for n_tok in cfg.long_prompts:
        mb, ms, gbs = (_positive(c) for c in _cells(report, str(n_tok))[:3])
        assert mb > 0 and ms > 0 and gbs > 0
        ttft_row = [c for c in report.splitlines() if c.startswith(f"| {n_tok} |")][1]
        values = [_positive(c) for c in ttft_row.strip("|").split("|")[1:]]
        assert len(values) == 7 and all(v > 0 for v in values), ttft_row

    targets = [line for line in report.splitlines() if line.endswith(("| PASS |", "| FAIL |"))]
    assert len(targets) == 2 + 2 * len(cfg.long_prompts), targets
    assert "load average before" in report and "torch thread(s)" in report
