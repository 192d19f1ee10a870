"""`plan` moves the split toward the phase a workload loads: a prompt-heavy mix gets more
prefill replicas than a decode-heavy one; colocation wins where moving KV costs more than it
saves; the search over many replicas finds the exhaustive search's best; the written Serve
config loads through the real `AppConfig` loader."""

from __future__ import annotations

import pytest

from cluster.cli.serve import read_serve_file
from cluster.planner.planner import MAX_EXHAUSTIVE, plan
from cluster.planner.profile import (
    DecodeStepModel,
    EngineLimits,
    KVTransferModel,
    Overheads,
    PrefillStepModel,
    Profile,
)
from cluster.planner.serve_config import serve_config
from cluster.planner.sim_workload import RequestClass, mix_requests
from cluster.planner.simulator import ClusterShape, Simulator
from cluster.serving.app import config_from_args

GPU_LIKE = Profile(
    PrefillStepModel(0.015, 6e-5, 1e-9),
    DecodeStepModel(0.008, 1e-4, 2e-8),
    (KVTransferModel("nixl", 0.002, 20e9, 131072),),
    Overheads(0.001, 0.001),
    EngineLimits(128, 8192, 20000, 16),
)


def best_split(classes, rate, replicas=6):
    """The best disaggregated candidate's prefill replicas, and the plan."""
    reqs = mix_requests(classes, 120, rate, 16, seed=3)
    result = plan(GPU_LIKE, reqs, replicas, 1.0, 0.05)
    split = [c for c in result.candidates if c.shape.mode == "disaggregated"]
    return max(split, key=lambda c: c.rank()).shape.prefill_replicas, result


def test_a_prompt_heavy_mix_gets_more_prefill_replicas_than_a_decode_heavy_one():
    prompt_heavy, a = best_split([RequestClass(6000, 8)], 30.0)
    decode_heavy, b = best_split([RequestClass(200, 200)], 30.0)
    assert prompt_heavy >= 4 and decode_heavy <= 2, (prompt_heavy, decode_heavy)
    # every split and colocation was simulated, each with its bottleneck named
    assert [c.shape.describe() for c in a.candidates][:2] == ["6 colocated", "1P:5D"]
    assert len(a.candidates) == 6 and all(c.summary.bottleneck for c in a.candidates)
    assert a.candidates[1].summary.bottleneck.startswith("ttft: prefill")


def test_colocation_wins_when_the_kv_hop_is_dear():
    dear = Profile(
        GPU_LIKE.prefill,
        GPU_LIKE.decode,
        (KVTransferModel("grpc", 0.5, 1e8, 131072),),  # half a second a hop
        GPU_LIKE.overheads,
        GPU_LIKE.limits,
    )
    reqs = mix_requests([RequestClass(512, 64)], 200, 10.0, 16, seed=1)
    result = plan(dear, reqs, 4, 0.4, 0.1)
    assert result.best.shape.mode == "colocated"
    disagg = [c for c in result.candidates if c.shape.mode == "disaggregated"]
    assert all(c.summary.phase_mean_s["kv_transfer"] >= 0.5 for c in disagg)
    assert all(c.summary.goodput_rps < result.best.summary.goodput_rps for c in disagg)


def test_the_coarse_search_finds_the_exhaustive_best():
    replicas = MAX_EXHAUSTIVE + 2
    reqs = mix_requests([RequestClass(3000, 32), RequestClass(300, 128)], 150, 50.0, 16, seed=2)
    coarse = plan(GPU_LIKE, reqs, replicas, 0.5, 0.03)
    evaluated = {c.shape.prefill_replicas for c in coarse.candidates[1:]}
    assert len(evaluated) < replicas - 1
    every = []
    for p in range(1, replicas):
        shape = ClusterShape(prefill_replicas=p, decode_replicas=replicas - p)
        every.append(Simulator(GPU_LIKE, shape).run(reqs).summary(0.5, 0.03).goodput_rps)
    best_split = max(c.summary.goodput_rps for c in coarse.candidates[1:])
    assert best_split == pytest.approx(max(every))


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_the_serve_config_loads_through_the_app_config_loader(tmp_path, mode):
    import yaml

    shape = ClusterShape(mode=mode, prefill_replicas=3, decode_replicas=5)
    doc = serve_config(shape, GPU_LIKE.limits, "grpc")
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    (app,) = read_serve_file(path)["applications"]
    config = config_from_args(app["args"])
    assert config.mode == mode and config.decode.replicas == 5
    assert config.decode.scheduler.max_num_seqs == 128
    assert config.decode.cache.num_blocks == 20000
    if mode == "disaggregated":
        assert config.prefill.replicas == 3 and config.transfer.transport == "grpc"


def test_a_base_config_keeps_everything_but_mode_and_sizes(tmp_path):
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[3]
    base = yaml.safe_load((root / "deploy" / "serve" / "local-cpu.yaml").read_text())
    doc = serve_config(
        ClusterShape(prefill_replicas=2, decode_replicas=3), GPU_LIKE.limits, base=base
    )
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    (app,) = read_serve_file(path)["applications"]
    config = config_from_args(app["args"])
    assert (config.prefill.replicas, config.decode.replicas) == (2, 3)
    assert config.decode.cache.num_blocks == 512  # the base file's
    assert app["deployments"] == base["applications"][0]["deployments"]
