"""Smoke test of the packed-GEMM benchmark: a row per row count, both timings positive."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import linear_bench
from cluster.model.linear import load_packed_gemm
from cluster.model.make_model import make_model


def test_quick_run_reports_every_row_count(tmp_path: Path) -> None:
    if load_packed_gemm() is None:
        pytest.skip("packed GEMM unavailable here (tests/cluster/model/test_linear.py says why)")
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    report = linear_bench.main(
        ["--model-dir", str(model_dir), "--rows", "1,8,200", "--repeats", "2", "--threads", "1"]
        + ["--out", str(tmp_path / "report.md")]
    )
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", report, re.M)
    assert [int(r[0]) for r in rows] == [1, 8, 200]
    assert all(float(x) > 0 for r in rows for x in r[1:])
