"""Smoke test of the interference benchmark, and the GIL switch interval the engine replicas
set (the setting the benchmark motivates)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import interference_bench
from cluster.errors import InvalidArgument
from cluster.model.make_model import make_model
from cluster.serving.app_config import PoolConfig


def test_quick_run_reports_every_case(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    argv = ["--model-dir", str(model_dir), "--tokens", "8", "--rounds", "1", "--period-ms", "5"]
    out = tmp_path / "report.md"
    report = interference_bench.main([*argv, "--busy-ms", "1", "--out", str(out)])
    assert out.read_text("utf-8") == report
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([+-][\d.]+) \|$", report, re.M)
    assert len(rows) == 4 and rows[0][0] == "alone" and rows[0][2] == "+0.0"
    assert all(float(step) > 0 for _, step, _ in rows)


@pytest.mark.parametrize("bad", [0.0, -1e-3, 2.0])
def test_gil_switch_interval_must_be_sensible(bad: float) -> None:
    with pytest.raises(InvalidArgument, match="gil_switch_interval_s"):
        PoolConfig(gil_switch_interval_s=bad)
