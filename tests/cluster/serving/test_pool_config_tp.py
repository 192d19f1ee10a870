"""A pool's `tensor_parallel_size` (cluster/serving/pool_config.py): its bounds, the Serve
options it makes (one placement-group bundle per rank, STRICT_PACK, the replica's actor in the
first), what the cluster must hold for it, and the sizes a disaggregated app takes (1, 2, 4
per pool, split by the checkpoint). The apps serving with it: tests/e2e/test_tensor_parallel_*.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.config import ConfigError, ModelConfig
from cluster.errors import InvalidArgument, ResourceExhausted
from cluster.serving.app import build_app, deployment_options, override_conflicts
from cluster.serving.app_config import AppConfig
from cluster.serving.gpu_placement import ClusterView, engine_gpus
from cluster.serving.placement import check_fits, demands
from cluster.serving.pool_config import TP_STRATEGY, PoolConfig
from tests.conftest import build_checkpoint

MODEL = ModelConfig(path="/models/m")


def colocated(**pool) -> AppConfig:
    return AppConfig(model=MODEL, mode="colocated", decode=PoolConfig(**pool))


def test_tp_defaults_to_1_and_takes_the_powers_of_two_up_to_8():
    assert PoolConfig().tensor_parallel_size == 1
    for k in (1, 2, 4, 8):
        assert PoolConfig(tensor_parallel_size=k).tensor_parallel_size == k


@pytest.mark.parametrize("k", [0, -1, 3, 6, 16])
def test_other_sizes_are_refused(k):
    with pytest.raises(ConfigError, match=f"tensor_parallel_size must be one of .*got {k}"):
        PoolConfig(tensor_parallel_size=k)


def test_the_dict_form_refuses_a_bad_size_at_its_path():
    args = {"model": {"path": "/m"}, "mode": "colocated", "decode": {"tensor_parallel_size": 3}}
    with pytest.raises(InvalidArgument, match="decode: tensor_parallel_size must be one of"):
        AppConfig.from_dict(args)
    with pytest.raises(InvalidArgument, match="decode.tensor_parallel_size"):
        AppConfig.from_dict({**args, "decode": {"tensor_parallel_size": "2"}})
    ok = AppConfig.from_dict({**args, "decode": {"tensor_parallel_size": 2}})
    assert ok.decode.tensor_parallel_size == 2
    assert AppConfig.from_dict(ok.to_dict()) == ok


def test_the_router_refuses_the_engine_setting():
    with pytest.raises(InvalidArgument, match="router.*tensor_parallel_size"):
        AppConfig.from_dict({"model": {"path": "/m"}, "router": {"tensor_parallel_size": 2}})


def test_a_rank_needs_cpus_and_at_most_one_gpu():
    with pytest.raises(ConfigError, match="num_cpus > 0"):
        PoolConfig(tensor_parallel_size=2, num_cpus=0)
    with pytest.raises(ConfigError, match="num_gpus 0 or 1 a rank, got 0.5"):
        PoolConfig(tensor_parallel_size=2, num_gpus=0.5)
    assert PoolConfig(tensor_parallel_size=1, num_gpus=0.5).num_gpus == 0.5


def test_a_disaggregated_app_takes_tp_1_2_4_in_either_pool_and_refuses_8_naming_both():
    for prefill, decode in [(2, 1), (1, 2), (4, 4), (1, 4)]:
        pools = {
            "prefill": PoolConfig(tensor_parallel_size=prefill),
            "decode": PoolConfig(tensor_parallel_size=decode),
        }
        assert AppConfig(model=MODEL, **pools).decode.tensor_parallel_size == decode
    with pytest.raises(ConfigError, match="prefill 8, decode 2: KV moves between TP sizes"):
        AppConfig(
            model=MODEL,
            prefill=PoolConfig(tensor_parallel_size=8),
            decode=PoolConfig(tensor_parallel_size=2),
        )


def test_a_tp_size_the_checkpoint_does_not_split_is_refused_when_the_app_is_built(tmp_path):
    # 6 heads over 3 KV heads: TP 2 splits the heads but not the KV heads.
    path = build_checkpoint(
        "llama-gqa", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    config = AppConfig(
        model=ModelConfig(str(path)),
        prefill=PoolConfig(tensor_parallel_size=1),
        decode=PoolConfig(tensor_parallel_size=2),
    )
    with pytest.raises(ConfigError, match="prefill tensor_parallel_size 1 -> decode 2: .*KV heads"):
        config.resolved()
    assert replace(config, mode="colocated", decode=PoolConfig()).resolved()


def test_a_colocated_app_takes_tp_and_ignores_the_unused_prefill_pool():
    config = AppConfig(
        model=MODEL,
        mode="colocated",
        prefill=PoolConfig(tensor_parallel_size=4),
        decode=PoolConfig(tensor_parallel_size=2),
    )
    assert config.pool("colocated").tensor_parallel_size == 2


def test_tp1_deployments_have_no_placement_group():
    options = deployment_options("Colocated", colocated(num_gpus=0.0).decode)
    assert "placement_group_bundles" not in options
    assert "placement_group_strategy" not in options


def test_a_cpu_tp_replica_reserves_one_bundle_per_rank_strictly_packed():
    pool = colocated(tensor_parallel_size=4, num_cpus=2, num_gpus=0.0).decode
    options = deployment_options("Colocated", pool)
    assert options["placement_group_bundles"] == [{"CPU": 2.0}] * 4
    assert options["placement_group_strategy"] == TP_STRATEGY == "STRICT_PACK"
    assert options["ray_actor_options"]["num_cpus"] == 2.0  # rank 0: the first bundle
    assert options["ray_actor_options"]["num_gpus"] == 0.0


def test_a_gpu_tp_replica_reserves_a_gpu_in_every_ranks_bundle():
    """Each rank is an actor of its own in its bundle (rank 0 the replica's), with one GPU;
    custom resources are the replica's, so they are in the first bundle only."""
    pool = colocated(tensor_parallel_size=2, num_gpus=1, resources={"gpu_pool": 1}).decode
    options = deployment_options("Colocated", pool)
    assert options["placement_group_bundles"] == [
        {"CPU": 1.0, "GPU": 1.0, "gpu_pool": 1.0},
        {"CPU": 1.0, "GPU": 1.0},
    ]
    actor = options["ray_actor_options"]
    assert (actor["num_gpus"], actor["resources"]) == (1.0, {"gpu_pool": 1.0})


@pytest.mark.parametrize("gpus", [0.0, 1])
def test_serve_accepts_the_tp_options(gpus):
    """Serve's own check: a deployment's actor must fit in its first bundle."""
    from ray import serve

    pool = colocated(tensor_parallel_size=2, num_gpus=gpus, resources={"pool": 1}).decode
    built = serve.deployment(type("Colocated", (), {}), **deployment_options("Colocated", pool))
    replica = built._replica_config
    assert len(replica.placement_group_bundles) == 2
    assert replica.placement_group_strategy == "STRICT_PACK"


def test_the_built_colocated_app_carries_them():
    app = build_app(colocated(tensor_parallel_size=2, num_gpus=0.0))
    (pool,) = [a for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
    replica = pool._bound_deployment._replica_config
    assert replica.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert replica.placement_group_strategy == "STRICT_PACK"


def test_a_serve_config_entry_must_not_change_the_placement():
    config = colocated(tensor_parallel_size=2, num_gpus=0.0)
    bundles = [{"CPU": 1.0}, {"CPU": 1.0}]
    same = {"name": "Colocated", "placement_group_bundles": bundles}
    assert override_conflicts(config, [same]) == []
    other = {"name": "Colocated", "placement_group_strategy": "SPREAD"}
    (problem,) = override_conflicts(config, [other])
    assert "placement_group_strategy is SPREAD" in problem and "STRICT_PACK" in problem


def test_a_tp_replica_counts_every_ranks_resources():
    config = colocated(tensor_parallel_size=4, replicas=2, num_cpus=1.5, num_gpus=1)
    (_, pool) = demands(config)
    assert pool.per_replica == {"CPU": 6.0, "GPU": 4.0}
    with pytest.raises(ResourceExhausted, match="8 GPU in all"):
        check_fits([config], {"CPU": 64.0, "GPU": 4.0})


def test_a_tp_replicas_gpus_must_be_on_one_node():
    pool = PoolConfig(tensor_parallel_size=4, num_gpus=1)
    view = ClusterView(({"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}))
    with pytest.raises(ConfigError, match="asks 4 GPU per replica"):
        engine_gpus("decode", pool, "cuda", view)
    assert engine_gpus("decode", pool, "cuda", ClusterView(({"GPU": 4.0},))) == 1.0
