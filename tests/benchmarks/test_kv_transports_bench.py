"""Smoke test of the KV transports benchmark: prefill processes serving nixl + grpc and gloo,
a row per transport and prompt length with positive timings (each transfer checked bit-exact
inside the benchmark)."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks import kv_transports_bench
from cluster.model.make_model import make_model


def test_quick_run_reports_every_transport_and_length(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    out = tmp_path / "report.md"
    argv = ["--model-dir", str(model_dir), "--prompt-lens", "20,40", "--repeats", "1"]
    report = kv_transports_bench.main([*argv, "--threads", "1", "--out", str(out)])
    assert out.read_text("utf-8") == report
    row = r"^\| ([a-z ,+]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|"
    rows = re.findall(row, report, re.M)
    names = ["grpc", "nixl", "gloo"]
    assert [(r[0], r[1]) for r in rows] == [(n, length) for n in names for length in ("20", "40")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)
