"""The routing benchmark, small, on the session's Ray and Serve (tiny model).

Timings say nothing on a 2-core test machine; what the run shows regardless is the routing
itself: with prefix affinity every repeat finds its whole prefix cached, though each app has
2 router replicas that know nothing of each other's calls, both apps give the same tokens, and
no KV blocks are left behind (the full runs' reports are in benchmarks/results/).
"""

from __future__ import annotations

from benchmarks import routing_bench
from tests.benchmarks.bench_report import cells


def test_small_run_caches_every_repeat_with_affinity_and_leaks_nothing(
    ray_serve, tokenizer_model_dir, tmp_path
):
    args = ["--model-dir", str(tokenizer_model_dir), "--tenants", "4", "--prefix", "48"]
    args += ["--suffix", "4", "--rounds", "3", "--num-blocks", "64", "--routers", "2"]
    args += ["--out", str(tmp_path / "report.md")]
    report = routing_bench.main([*args, "--grpc-port", str(ray_serve.grpc_port)])

    affinity, _ = cells(report, "repeats (rounds 2-3) with their whole prefix cached")
    assert affinity == "8 / 8", report
    assert cells(report, "prefixes served by more than one replica")[0] == "0"
    assert cells(report, "KV blocks used or leased after the run") == ["0", "0"]
    assert "Same tokens from both apps for every prompt: yes" in report
    ttft = cells(report, "median TTFT, rounds 2-3 (ms)")
    assert all(float(cell) > 0 for cell in ttft)
