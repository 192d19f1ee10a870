"""Smoke test of the engine benchmark script: it runs end to end and reports every row."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import engine_bench
from benchmarks.engine_systems import SYSTEMS
from cluster.model.make_model import make_model


def test_quick_run_reports_every_row(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    out = tmp_path / "report.md"
    report = engine_bench.main(
        ["--quick", "--model-dir", str(model_dir), "--threads", "1", "--out", str(out)]
    )

    assert out.read_text("utf-8") == report
    rows = {}
    for line in report.splitlines():
        m = re.match(r"\| (decode|prefill), batch (\d+) \| (.+) \|$", line)
        if m:
            cells = [c.strip().rstrip("x").replace(",", "") for c in m[3].split("|")]
            rows[(m[1], int(m[2]))] = [float(c) for c in cells]
    assert set(rows) == {(kind, b) for kind in ("decode", "prefill") for b in (1, 2)}
    for cells in rows.values():
        assert len(cells) == len(SYSTEMS) + 1  # systems plus the ratio
        assert all(c > 0 for c in cells)
    assert re.search(r"Target batch-1 decode step .*: (PASS|FAIL)$", report, re.M)
    assert "Copy bandwidth:" in report
