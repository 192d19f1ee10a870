"""Smoke test of the engine benchmark script: it runs end to end and reports every row, in
Markdown and as JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import engine_bench
from benchmarks.engine_systems import SYSTEMS
from cluster.model.make_model import make_model


def test_quick_run_reports_every_row(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    out, figures = tmp_path / "report.md", tmp_path / "figures.json"
    report = engine_bench.main(
        ["--quick", "--model-dir", str(model_dir), "--threads", "1", "--out", str(out)]
        + ["--json", str(figures)]
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

    run = json.loads(figures.read_text("utf-8"))
    assert (run["preset"], run["device"], run["dtype"]) == ("tiny", "cpu", "float32")
    assert run["cuda_graphs"] is False  # graphs are a GPU path
    assert (run["prompt_len"], run["batch_tokens"]) == (16, 4096)
    assert run["floor_step_s"] == run["weight_bytes"] / run["copy_bandwidth"] > 0
    measured = {(m["system"], m["batch"]): m for m in run["results"]}
    assert set(measured) == {(s, b) for s in SYSTEMS for b in (1, 2)}
    decode_b1 = f"{measured['pdserve', 1]['decode_tok_s']:,.1f}"
    assert f"| decode, batch 1 | {decode_b1} |" in report


def test_structured_mode_reports_the_constrained_step_beside_the_free_one(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "tiny", seed=0)
    out, figures = tmp_path / "engine.md", tmp_path / "figures.json"
    argv = ["--quick", "--structured", "--model-dir", str(model_dir), "--batches", "2"]
    report = engine_bench.main([*argv, "--out", str(out), "--json", str(figures)])

    assert (tmp_path / "engine_structured.md").read_text("utf-8") == report  # its own report
    assert not out.exists()
    [row] = re.findall(r"^\| 2 \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", report, re.M)
    free, constrained, ratio = map(float, row)
    assert free > 0 and constrained > 0
    assert abs(ratio - constrained / free) <= 0.01 + 0.05 * constrained / free  # rounded cells
    assert json.loads(figures.read_text("utf-8")).keys() == {"2"}
    assert '"minItems": 1024' in report
