"""What an app asks of the cluster, the logical CPUs a local Ray gets for it, and a refusal that
names the pool, what it needs and what the cluster has."""

from __future__ import annotations

import pytest

from cluster.config import ModelConfig
from cluster.errors import ResourceExhausted
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.autoscaling import AutoscalingSettings
from cluster.serving.gpu_placement import ClusterView
from cluster.serving.placement import (
    MIN_LOCAL_CPUS,
    check_fits,
    check_tp_groups,
    demands,
    local_cpus,
)

MODEL = ModelConfig("/models/m")


def two_by_two(**pool) -> AppConfig:
    return AppConfig(
        MODEL, prefill=PoolConfig(replicas=2, **pool), decode=PoolConfig(replicas=2, **pool)
    )


def test_each_deployment_states_its_replicas_and_resources():
    config = two_by_two()
    got = {d.deployment: (d.pool, d.replicas, d.per_replica) for d in demands(config)}
    assert got == {
        "Router": ("router", 1, {"CPU": 0.5}),
        "Prefill": ("prefill", 2, {"CPU": 1.0}),
        "Decode": ("decode", 2, {"CPU": 1.0}),
    }


def test_a_local_ray_gets_cpus_for_every_replica_asked_for(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert local_cpus([two_by_two()]) == 5  # 4 engines x 1 + the router's 0.5, rounded up
    assert local_cpus([AppConfig(MODEL)]) == MIN_LOCAL_CPUS
    scaling = AutoscalingSettings(min_replicas=1, max_replicas=6)
    assert local_cpus([AppConfig(MODEL, decode=PoolConfig(autoscaling=scaling))]) == 8


def test_what_fits_passes():
    check_fits([two_by_two()], {"CPU": 5.0, "memory": 1e9})
    assert demands(two_by_two())[1].describe() == "pool prefill (deployment Prefill): 2 x {CPU: 1}"


def test_what_cannot_fit_names_the_pool_its_need_and_the_cluster():
    config = two_by_two(num_gpus=1.0)
    with pytest.raises(ResourceExhausted) as e:
        check_fits([config], {"CPU": 5.0, "GPU": 1.0, "node:127.0.0.1": 1.0})
    message = e.value.message
    assert "pool prefill (deployment Prefill): 2 x {CPU: 1, GPU: 1}" in message
    assert "pool decode (deployment Decode)" in message
    assert "4 GPU in all, the cluster has {CPU: 5, GPU: 1}" in message
    assert "node:" not in message and "\n" not in message


def test_a_custom_resource_the_cluster_lacks_is_refused():
    config = AppConfig(MODEL, decode=PoolConfig(resources=(("decode_pool", 1.0),)))
    with pytest.raises(ResourceExhausted, match=r"pool decode .*decode_pool: 1.*1 decode_pool"):
        check_fits([config], {"CPU": 8.0})


def tp_app(k: int, **pool) -> AppConfig:
    return AppConfig(MODEL, mode="colocated", decode=PoolConfig(tensor_parallel_size=k, **pool))


def test_a_tp_replica_no_node_can_hold_is_refused_naming_pool_k_and_nodes():
    # 8 CPUs in all, but a TP 4 replica of 3 CPUs a rank needs 12 on one node
    small = ClusterView(({"CPU": 4.0, "memory": 1e9}, {"CPU": 4.0}))
    with pytest.raises(ResourceExhausted) as e:
        check_tp_groups([tp_app(4, num_cpus=3.0, num_gpus=0.0)], small)
    assert e.value.message == (
        "pool decode: a replica of tensor_parallel_size 4 needs {CPU: 12} on one node (a bundle "
        "per rank, STRICT_PACK), but no node of the cluster has that: 2 nodes: 2 x {CPU: 4}"
    )
    # GPUs: 8 in the cluster, 4 a node; a TP 8 replica of one GPU a rank fits on none
    gpus = ClusterView(({"CPU": 64.0, "GPU": 4.0},) * 2)
    with pytest.raises(ResourceExhausted, match=r"tensor_parallel_size 8 needs \{CPU: 8, GPU: 8\}"):
        check_tp_groups([tp_app(8, num_gpus=1.0)], gpus)
    check_tp_groups([tp_app(4, num_gpus=1.0)], gpus)  # 4 ranks' GPUs on one node: fits
    check_tp_groups([tp_app(1, num_cpus=16.0, num_gpus=0.0)], small)  # TP 1: check_fits' job


def test_a_tp_replica_counts_only_the_nodes_with_its_custom_resources():
    pool = {"num_gpus": 1.0, "resources": (("decode_gpu", 1.0),)}
    view = ClusterView(({"CPU": 8.0}, {"CPU": 96.0, "GPU": 2.0, "decode_gpu": 1.0}))
    with pytest.raises(ResourceExhausted, match=r"no node of the cluster with \{decode_gpu: 1\}"):
        check_tp_groups([tp_app(4, **pool)], view)
    # No live node has the resource yet: an autoscaler may add one, so nothing is refused.
    check_tp_groups([tp_app(4, **pool)], ClusterView(({"CPU": 8.0},)))
