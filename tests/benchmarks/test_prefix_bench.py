"""Smoke test of the prefix caching benchmark: it runs, finds the shared prefix cached, and the
tokens agree with caching off."""

from __future__ import annotations

from pathlib import Path

from benchmarks import prefix_bench
from cluster.model.make_model import make_model


def test_quick_run_reports_the_cached_prefix(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    out = tmp_path / "report.md"
    argv = ["--model-dir", str(model_dir), "--prefix", "32", "--suffix", "5", "--requests", "3"]
    report = prefix_bench.main([*argv, "--threads", "1", "--out", str(out)])
    assert out.read_text("utf-8") == report
    assert "| later requests, cached prompt tokens | 32 | 0 | |" in report
    assert "Same first tokens with and without caching: yes." in report
