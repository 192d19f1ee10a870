"""`pdserve plan` end to end on the recorded profile (`cluster/planner/profiles/`): the Mooncake
trace slice of benchmarks/results/trace.md on 2 replicas, every candidate printed with its
goodput, attainment and bottleneck, and the chosen shape written as a Serve config that the
real loader (`pdserve serve --config`'s check, then `AppConfig`) accepts."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.cli.main import main
from cluster.cli.serve import read_serve_file
from cluster.serving.app import config_from_args

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "cluster" / "planner" / "profiles" / "cpu-small-v1.json"
SLICE = [
    "--trace", "mooncake", "--skip", "3800", "--max-requests", "60",
    "--length-scale", "0.03125", "--time-scale", "8",
]  # fmt: skip


def test_plan_prints_every_candidate_and_writes_a_loadable_serve_config(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    argv = ["plan", "--profile", str(PROFILE), *SLICE, "--replicas", "3"]
    argv += ["--slo-ttft-ms", "5000", "--slo-itl-ms", "150", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    for shape in ("3 colocated", "1P:2D", "2P:1D"):
        assert f"| {shape}" in text
    best = text.strip().splitlines()[-1].removeprefix("best: ")
    (app,) = read_serve_file(out)["applications"]
    config = config_from_args(app["args"])
    if best.endswith("colocated"):
        assert config.mode == "colocated" and config.decode.replicas == 3
    else:
        p, d = (int(x[:-1]) for x in best.split(":"))
        assert config.mode == "disaggregated"
        assert (config.prefill.replicas, config.decode.replicas) == (p, d)
        assert config.transfer.transport == "nixl"  # the profile's
    assert config.decode.scheduler.max_num_seqs == 32  # the profile's limits


def test_plan_json_agrees_with_the_table_and_a_mix_works(capsys):
    argv = ["plan", "--profile", str(PROFILE), "--mix", "64:32", "512:4:2", "--rate", "0.5"]
    argv += ["--num-requests", "40", "--replicas", "2", "--slo-ttft-ms", "3000"]
    assert main([*argv, "--slo-itl-ms", "200", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    shapes = [c["shape"] for c in doc["candidates"]]
    assert shapes == ["2 colocated", "1P:1D"]
    assert doc["best"]["shape"] in shapes
    best = next(c for c in doc["candidates"] if c["shape"] == doc["best"]["shape"])
    assert best["goodput_rps"] == max(c["goodput_rps"] for c in doc["candidates"])
    assert all(0 <= c["attainment"] <= 1 and c["bottleneck"] for c in doc["candidates"])


def test_plan_refuses_a_missing_workload_and_a_bad_profile(tmp_path, capsys):
    argv = ["plan", "--profile", str(PROFILE), "--replicas", "2"]
    argv += ["--slo-ttft-ms", "1", "--slo-itl-ms", "1"]
    assert main(argv) == 2
    assert "--trace or --mix" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", "--profile", str(bad), *argv[3:], "--mix", "16:16"]) == 2
    assert "version" in capsys.readouterr().err
