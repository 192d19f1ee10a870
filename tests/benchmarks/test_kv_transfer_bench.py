"""Smoke test of the KV transfer benchmark: a real KV server and client on loopback, a row per
chunk size with positive timings (each fetch checked bit-exact inside the benchmark)."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import kv_transfer_bench
from cluster.model.make_model import make_model


def test_quick_run_reports_every_chunk_size(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    out = tmp_path / "report.md"
    argv = ["--model-dir", str(model_dir), "--prompt-len", "40", "--chunks", "0.25,1"]
    report = kv_transfer_bench.main([*argv, "--repeats", "2", "--threads", "1", "--out", str(out)])
    assert out.read_text("utf-8") == report
    row = r"^\| ([\d.]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$"
    rows = re.findall(row, report, re.M)
    assert [r[0] for r in rows] == ["0.25", "1.00"]
    assert all(int(r[1]) > 0 and float(r[2]) > 0 for r in rows)
