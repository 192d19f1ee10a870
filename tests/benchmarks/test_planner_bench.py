"""The planner benchmark, quick, on the session's Ray and Serve (tiny model, 8 requests a run,
one load level).

Its figures say nothing on a loaded 2-core test machine; what the run shows regardless: a
profile is fitted and written beside the report, every run of every workload on both apps has
a predicted and a measured figure for each phase and p90 (no KV transfer row for colocated),
the acceptance section names plan's pick, and no request fails or leaves KV blocks behind.
"""

from __future__ import annotations

import json
import re

from benchmarks import planner_bench
from benchmarks.planner_figures import BOUNDS

NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def test_quick_run_reports_both_figures_for_every_row(ray_serve, tokenizer_model_dir, tmp_path):
    out = tmp_path / "planner.md"
    args = ["--model-dir", str(tokenizer_model_dir), "--quick", "--num-blocks", "256"]
    report = planner_bench.main([*args, "--out", str(out), "--grpc-port", str(ray_serve.grpc_port)])

    assert out.read_text() == report
    profile = json.loads((tmp_path / "planner_profile.json").read_text())
    assert profile["decode"]["base_s"] > 0 or profile["decode"]["per_seq_s"] > 0, profile
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in report.splitlines()
        if line.startswith("| ") and line.count("|") == 10 and "figure" not in line
    ]
    expected = {
        (w, mode, f)
        for w in ("prompt-heavy", "decode-heavy", "mooncake")
        for mode in ("disaggregated", "colocated")
        for f in BOUNDS
        if not (mode == "colocated" and f == "kv_transfer")
    }
    assert {(r[0], r[2], r[3]) for r in rows} == expected, report
    for r in rows:
        assert r[1] == "50%", r
        assert NUMBER.match(r[4]) and NUMBER.match(r[5]), r  # predicted and measured ms
        assert r[8] in ("yes", "no"), r
    assert "Requests failed: 0; KV blocks used or leased after the runs: 0." in report
    pick = re.search(r"- plan's pick: (1P:1D|2 colocated)", report)
    assert pick, report
    assert f"| {pick.group(1)} (picked) |" in report
    for line in ("measured goodput / the best measured", "predicted - measured attainment"):
        assert re.search(line + r".*(PASS|FAIL)", report), report
