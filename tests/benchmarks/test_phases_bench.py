"""The phases benchmark, small, on the session's Ray and Serve (tiny model, one short
workload): `pdserve phases`' report of each workload lands in one report of its own."""

from __future__ import annotations

from benchmarks import phases_bench
from tests.benchmarks.bench_report import cells


def test_each_workload_gets_its_phases_report(
    ray_serve, tokenizer_model_dir, tmp_path, monkeypatch
):
    workload = ["--num-requests", "2", "--input-len", "48", "--output-len", "6"]
    monkeypatch.setattr(phases_bench, "WORKLOADS", {"two short prompts": workload})
    out = tmp_path / "report.md"
    argv = ["--model-dir", str(tokenizer_model_dir), "--out", str(out)]
    report = phases_bench.main([*argv, "--grpc-port", str(ray_serve.grpc_port)])

    assert out.read_text("utf-8") == report
    assert report.startswith("# pdserve phases: which phase dominates\n")
    assert "- commit: " in report and "\n## two short prompts\n" in report
    predicted, _, measured, _ = cells(report, "prefill")[:4]
    assert float(predicted) > 0 and float(measured) > 0
    assert "Dominant phase: predicted **" in report
