"""The trace benchmark, small, on the session's Ray and Serve (tiny model, a six-request trace).

Timings say nothing on a 2-core test machine; what the run shows regardless: both apps serve
every request of the replay with the same tokens, each finds every shared prefix the trace
makes reusable in its prefix cache, and no KV blocks are left behind (the full run's report
is in benchmarks/results/).
"""

from __future__ import annotations

from benchmarks import trace_bench
from tests.benchmarks.bench_report import cells
from tests.traces import SHARED_PREFIX_TRACE, write_trace


def test_small_replay_serves_everything_alike_and_leaks_nothing(
    ray_serve, tokenizer_model_dir, tmp_path
):
    trace = write_trace(tmp_path / "trace.jsonl", SHARED_PREFIX_TRACE)
    args = ["--model-dir", str(tokenizer_model_dir), "--trace", str(trace), "--skip", "0"]
    args += ["--time-scale", "1", "--num-blocks", "128", "--out", str(tmp_path / "report.md")]
    report = trace_bench.main([*args, "--grpc-port", str(ray_serve.grpc_port)])

    assert cells(report, "requests completed")[:2] == ["6", "6"], report
    assert cells(report, "prompt tokens from the prefix cache")[:2] == ["80", "80"], report
    assert cells(report, "KV blocks used or leased after the run")[:2] == ["0", "0"]
    assert "Same tokens from both apps for every request: yes" in report
    assert "could serve 80 of the 237 prompt tokens" in report
    assert all(float(c) > 0 for c in cells(report, "TTFT p50 (ms)")[:2])
