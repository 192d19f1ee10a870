"""Planning GPUs with tensor parallelism: a replica at TP k steps with the profile's models for
k (closed forms on a profile whose TP 2 steps are exactly half its TP 1 steps), the shapes of
N GPUs, the sizes mirrored from the app's config, refusals, and `pdserve plan --gpus` end to
end on the hand-written H100 profile with `--out` loaded back through the app's checks."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from cluster.cli.main import main
from cluster.cli.serve import read_serve_file
from cluster.planner import planner
from cluster.planner.planner import gpu_shapes, plan_gpus
from cluster.planner.profile import (
    DecodeStepModel,
    EngineLimits,
    KVTransferModel,
    Overheads,
    PrefillStepModel,
    Profile,
    TPModels,
)
from cluster.planner.sim_workload import RequestClass, SimRequest, mix_requests
from cluster.planner.simulator import ClusterShape, Simulator
from cluster.planner.step_fit import attended_tokens
from cluster.serving import pool_config
from cluster.serving.app import config_from_args

H100 = Path(__file__).resolve().parents[3] / "cluster/planner/profiles/h100-llama3.1-8b-v1.json"
LIMITS = EngineLimits(64, 8192, 4096, 16)
TP1 = (PrefillStepModel(0.004, 5e-5, 2e-9), DecodeStepModel(0.008, 1e-4, 4e-8))


def halved(k: int) -> TPModels:
    """Steps exactly 1/k of TP 1's (no all-reduce cost), k times the KV blocks."""
    pre, dec = TP1
    return TPModels(
        k,
        PrefillStepModel(pre.base_s / k, pre.per_token_s / k, pre.per_attended_s / k),
        DecodeStepModel(dec.base_s / k, dec.per_seq_s / k, dec.per_context_s / k),
        replace(LIMITS, num_kv_blocks=LIMITS.num_kv_blocks * k),
    )


IDEAL = Profile(
    *TP1,
    (KVTransferModel("nixl", 0.002, 20e9, 131072),),
    Overheads(0.0, 0.0),
    LIMITS,
    tensor_parallel=(halved(2), halved(4)),
)


def colocated(replicas: int, tp: int) -> ClusterShape:
    return ClusterShape("colocated", 0, replicas, decode_tp=tp)


def test_a_tp2_replica_halves_a_long_prompts_ttft():
    long = [SimRequest(0.0, 20_000, 1, [])]  # three chunks of at most 8,192 tokens
    (one,) = Simulator(IDEAL, colocated(1, 1)).run(long).outcomes
    (two,) = Simulator(IDEAL, colocated(1, 2)).run(long).outcomes
    assert two.ttft_s == pytest.approx(one.ttft_s / 2, rel=1e-12)
    # and it is the profile's three chunk steps at TP 1, summed
    chunks = [(0, 8192), (8192, 16384), (16384, 20000)]
    steps = [IDEAL.prefill.time(b - a, attended_tokens(a, b)) for a, b in chunks]
    assert one.ttft_s == pytest.approx(sum(steps), rel=1e-12)


def test_a_tp2_replica_on_two_gpus_has_two_tp1_replicas_capacity_for_prompts():
    # 40 prompts of one step each, all at once, one token out: prefill throughput alone.
    reqs = mix_requests([RequestClass(8000, 1)], 40, float("inf"), 16, seed=0)
    step = IDEAL.prefill.time(8000, attended_tokens(0, 8000))
    pair = Simulator(IDEAL, colocated(2, 1)).run(reqs)
    single = Simulator(IDEAL, colocated(1, 2)).run(reqs)
    last = {name: max(o.token_times[0] for o in r.outcomes) for name, r in
            (("pair", pair), ("single", single))}  # fmt: skip
    assert last["single"] == pytest.approx(40 * step / 2, rel=1e-9)
    assert last["pair"] == pytest.approx(40 * step / 2, rel=1e-9)  # the router splits 20 / 20
    # and the TP 2 replica holds the two TP 1 replicas' KV blocks
    assert IDEAL.at_tp(2).limits.num_kv_blocks == 2 * LIMITS.num_kv_blocks


def test_a_tp2_decode_step_is_half_and_beats_two_tp1_replicas_by_their_base():
    # 16 sequences decoding: at TP 2 each step is half TP 1's at 16; two TP 1 replicas at 8
    # each pay the whole base per step, so the TP 2 replica's TPOT is lower by base / 2.
    reqs = mix_requests([RequestClass(100, 50)], 16, float("inf"), 16, seed=0)
    tp2 = Simulator(IDEAL, colocated(1, 2)).run(reqs).summary()
    tp1 = Simulator(IDEAL, colocated(2, 1)).run(reqs).summary()
    assert tp2.tpot_s["p50"] < tp1.tpot_s["p50"]
    dec = TP1[1]
    expected_gap = dec.base_s / 2  # at equal context both pay per_seq x 8 and its context
    assert tp1.tpot_s["p50"] - tp2.tpot_s["p50"] == pytest.approx(expected_gap, rel=0.05)


def describe(shapes):
    return [s.describe(tp=True) for s in shapes]


def test_the_shapes_of_four_gpus():
    col, pairs = gpu_shapes(IDEAL, 4)
    assert describe(col) == ["4 colocated@TP1", "2 colocated@TP2", "1 colocated@TP4"]
    assert [describe(p) for p in pairs] == [
        ["1P@TP1:3D@TP1", "2P@TP1:2D@TP1", "3P@TP1:1D@TP1"],
        ["2P@TP1:1D@TP2"],  # 1P@TP1:1D@TP2 leaves a GPU idle, and 2P:1D uses all 4
        ["1P@TP2:2D@TP1"],
        ["1P@TP2:1D@TP2"],
    ]
    assert all(s.gpus == 4 for p in pairs for s in p)


def test_the_shapes_of_three_gpus_leave_one_idle_only_where_they_must():
    col, pairs = gpu_shapes(IDEAL, 3, (1, 2))
    assert describe(col) == ["3 colocated@TP1", "1 colocated@TP2"]
    assert [s.gpus for s in col] == [3, 2]
    assert [describe(p) for p in pairs] == [
        ["1P@TP1:2D@TP1", "2P@TP1:1D@TP1"],
        ["1P@TP1:1D@TP2"],
        ["1P@TP2:1D@TP1"],
    ]


def test_the_sizes_mirror_the_apps():
    assert planner.COLOCATED_TP_SIZES == pool_config.TENSOR_PARALLEL_SIZES
    assert planner.DISAGGREGATED_TP_SIZES == pool_config.DISAGGREGATED_TP_SIZES


def test_tp8_is_colocated_only_and_sizes_the_profile_lacks_are_refused():
    eight = replace(IDEAL, tensor_parallel=(*IDEAL.tensor_parallel, halved(8)))
    col, pairs = gpu_shapes(eight, 8, (1, 8))
    assert describe(col) == ["8 colocated@TP1", "1 colocated@TP8"]
    assert all(s.prefill_tp == s.decode_tp == 1 for p in pairs for s in p)
    with pytest.raises(ValueError, match="no models for TP \\[8\\]"):
        gpu_shapes(IDEAL, 8, (2, 8))
    with pytest.raises(ValueError, match="no app takes TP \\[3\\]"):
        gpu_shapes(replace(IDEAL, tensor_parallel=(halved(3),)), 6, (1, 3))


def test_plan_gpus_searches_every_pair_on_a_grid_above_the_threshold():
    reqs = mix_requests([RequestClass(3000, 32)], 60, 30.0, 16, seed=1)
    result = plan_gpus(IDEAL, reqs, 20, 1.0, 0.05, (1, 2))
    shapes = [c.shape for c in result.candidates]
    tp11 = [s for s in shapes if s.mode == "disaggregated" and s.prefill_tp == s.decode_tp == 1]
    assert 0 < len(tp11) < 19  # 19 splits: a grid, refined
    assert {(s.prefill_tp, s.decode_tp) for s in shapes if s.mode == "disaggregated"} == {
        (1, 1), (1, 2), (2, 1), (2, 2)
    }  # fmt: skip
    assert all(s.gpus == 20 for s in shapes)
    assert result.best is max(result.candidates, key=lambda c: c.rank())


def test_plan_gpus_through_the_cli_writes_each_pools_size(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    argv = ["plan", "--profile", str(H100), "--mix", "6000:64", "200:128", "--rate", "12"]
    argv += ["--num-requests", "120", "--slo-ttft-ms", "1000", "--slo-itl-ms", "40"]
    assert main([*argv, "--gpus", "8", "--out", str(out), "--json"]) == 0
    import json

    printed = json.loads(capsys.readouterr().out)
    shapes = [c["shape"] for c in printed["candidates"]]
    assert {"8 colocated@TP1", "4 colocated@TP2", "2 colocated@TP4", "1P@TP4:2D@TP2"} <= set(shapes)
    best = printed["best"]["shape"]
    assert all(c["gpus"] == 8 for c in printed["candidates"])
    assert out.read_text().startswith(f"# pdserve plan: {best} for ")
    (app,) = read_serve_file(out)["applications"]
    config = config_from_args(app["args"])
    profile = Profile.load(H100)
    if config.mode == "colocated":
        pools = {"decode": (config.decode.replicas, config.decode.tensor_parallel_size)}
        assert best == f"{pools['decode'][0]} colocated@TP{pools['decode'][1]}"
    else:
        p, d = config.prefill, config.decode
        assert best == f"{p.replicas}P@TP{p.tensor_parallel_size}:" + (
            f"{d.replicas}D@TP{d.tensor_parallel_size}"
        )
        blocks = profile.at_tp(p.tensor_parallel_size).limits.num_kv_blocks
        assert p.cache.num_blocks == blocks
    tp = config.decode.tensor_parallel_size
    assert config.decode.cache.num_blocks == profile.at_tp(tp).limits.num_kv_blocks


def test_the_cli_refuses_a_tp_size_the_profile_lacks(capsys):
    argv = ["plan", "--profile", str(H100), "--mix", "100:10", "--num-requests", "5"]
    argv += ["--slo-ttft-ms", "1000", "--slo-itl-ms", "50", "--gpus", "8"]
    assert main([*argv, "--tp-choices", "1", "8"]) == 2
    assert "no models for TP [8]" in capsys.readouterr().err
    assert main([*argv[:-2], "--replicas", "4", "--tp-choices", "2"]) == 2
    with pytest.raises(SystemExit):  # --replicas and --gpus together
        main([*argv, "--replicas", "4"])


def test_a_config_of_a_tp_shape_keeps_the_base_files_other_settings(tmp_path):
    from cluster.planner.serve_config import serve_config

    root = Path(__file__).resolve().parents[3]
    base = yaml.safe_load((root / "deploy" / "serve" / "local-cpu.yaml").read_text())
    shape = ClusterShape(prefill_replicas=2, decode_replicas=1, prefill_tp=2, decode_tp=4)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(serve_config(shape, LIMITS, base=base)))
    (app,) = read_serve_file(path)["applications"]
    config = config_from_args(app["args"])
    assert (config.prefill.replicas, config.prefill.tensor_parallel_size) == (2, 2)
    assert (config.decode.replicas, config.decode.tensor_parallel_size) == (1, 4)
    assert config.decode.cache.num_blocks == 512  # the base file's


def test_the_table_names_sizes_and_the_gpus_a_shape_leaves_idle(capsys):
    argv = ["plan", "--profile", str(H100), "--mix", "2000:32", "--rate", "5"]
    argv += ["--num-requests", "30", "--slo-ttft-ms", "1000", "--slo-itl-ms", "40"]
    assert main([*argv, "--gpus", "3", "--tp-choices", "1", "2"]) == 0
    text = capsys.readouterr().out
    assert "; 3 GPUs" in text
    rows = [line.split(" |")[0].lstrip("| ") for line in text.splitlines() if "@TP" in line]
    shapes = [r.replace(" **best**", "") for r in rows if not r.startswith("best")]
    assert shapes == [
        "3 colocated@TP1", "1 colocated@TP2 (2 GPUs)", "1P@TP1:2D@TP1", "2P@TP1:1D@TP1",
        "1P@TP1:1D@TP2", "1P@TP2:1D@TP1",
    ]  # fmt: skip
    assert text.rstrip().splitlines()[-1].startswith("best: ")
