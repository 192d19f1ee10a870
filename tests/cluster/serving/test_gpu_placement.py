"""Each engine pool's GPUs come from the cluster's nodes (a fake `ClusterView`: a list of node
resource dicts, as `ray.nodes()` reports them), never from the machine that builds the app; a pool
that asks for GPUs where its nodes have none is refused naming the pool, its GPUs and the nodes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.config import ConfigError, ModelConfig, TransferConfig
from cluster.errors import InvalidArgument
from cluster.serving import gpu_placement
from cluster.serving.app import deployment_options
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.gpu_placement import ClusterView, engine_gpus, place_gpus

CPU_HEAD = {"CPU": 8.0, "memory": 3e10, "object_store_memory": 1e10, "node:10.0.0.1": 1.0}
ROUTER_NODE = {"CPU": 16.0, "router_pool": 4.0}
PREFILL_NODE = {"CPU": 192.0, "GPU": 8.0, "prefill_pool": 8.0, "accelerator_type:H100": 1.0}
DECODE_NODE = {"CPU": 192.0, "GPU": 8.0, "decode_pool": 8.0}
CPU_DECODE_NODE = {"CPU": 64.0, "decode_pool": 8.0}
AWS = ClusterView((CPU_HEAD, ROUTER_NODE, PREFILL_NODE, DECODE_NODE, DECODE_NODE))
ALL_CPU = ClusterView((CPU_HEAD, {"CPU": 16.0}, {"CPU": 16.0}))


def app(device: str = "auto", dtype: str = "auto", **pools) -> AppConfig:
    model = ModelConfig("/models/m", device=device, dtype=dtype)
    return AppConfig(model, transfer=TransferConfig(transport="grpc"), **pools)


def pinned(name: str, **fields) -> PoolConfig:
    return PoolConfig(resources=((f"{name}_pool", 1.0),), **fields)


def test_a_cpu_head_with_gpu_engine_nodes_gives_each_engine_replica_one_gpu():
    placed = place_gpus(app(), ClusterView((CPU_HEAD, DECODE_NODE)))
    assert (placed.prefill.num_gpus, placed.decode.num_gpus) == (1.0, 1.0)
    assert deployment_options("Prefill", placed.prefill)["ray_actor_options"]["num_gpus"] == 1.0
    assert placed.router.num_gpus == 0.0  # the router runs no engine
    assert (placed.model.device, placed.model.dtype) == ("auto", "auto")  # left to the replicas


def test_the_pools_own_nodes_decide_by_their_custom_resources():
    config = app(prefill=pinned("prefill"), decode=pinned("decode"))
    placed = place_gpus(config, AWS)
    assert (placed.prefill.num_gpus, placed.decode.num_gpus) == (1.0, 1.0)
    # Decode nodes without GPUs: with an explicit dtype each pool goes its own way...
    mixed = ClusterView((CPU_HEAD, PREFILL_NODE, CPU_DECODE_NODE))
    placed = place_gpus(replace(config, model=replace(config.model, dtype="float32")), mixed)
    assert (placed.prefill.num_gpus, placed.decode.num_gpus) == (1.0, 0.0)
    # ...with dtype auto the two would pick different dtypes, and every KV transfer would fail.
    with pytest.raises(ConfigError, match=r"per replica prefill 1, decode 0.*set model\.dtype"):
        place_gpus(config, mixed)


def test_an_all_cpu_cluster_gives_none():
    placed = place_gpus(app(), ALL_CPU)
    assert (placed.prefill.num_gpus, placed.decode.num_gpus) == (0.0, 0.0)


@pytest.mark.parametrize(
    "config",
    [
        app(device="auto", prefill=PoolConfig(num_gpus=1)),
        app(device="cuda"),  # "auto" GPUs of a cuda model: one each
        app(device="cpu", prefill=PoolConfig(num_gpus=1)),
    ],
)
def test_gpus_asked_on_a_cluster_without_any_are_refused_naming_the_pool(config):
    with pytest.raises(ConfigError) as e:
        place_gpus(config, ALL_CPU)
    message = e.value.message
    assert message.startswith("pool prefill asks 1 GPU per replica, but the cluster has no node")
    assert "3 nodes: 1 x {CPU: 8}, 2 x {CPU: 16}" in message  # what the nodes have
    assert "memory" not in message and "node:" not in message


def test_more_gpus_than_any_of_the_pools_nodes_has_are_refused():
    config = app(decode=pinned("decode", num_gpus=16))
    with pytest.raises(ConfigError) as e:
        place_gpus(config, AWS)
    assert e.value.message == (
        "pool decode asks 16 GPU per replica on nodes with {decode_pool: 1}, but the cluster "
        "has no node with 16: 2 nodes: 2 x {CPU: 192, GPU: 8, decode_pool: 8}"
    )


def test_where_no_live_node_has_the_pools_resources_yet_only_a_stated_count_is_taken():
    waiting = ClusterView((CPU_HEAD,))  # the autoscaler has not started the pool's nodes
    stated = app(prefill=pinned("prefill", num_gpus=1), decode=pinned("decode", num_gpus=1))
    placed = place_gpus(stated, waiting)
    assert (placed.prefill.num_gpus, placed.decode.num_gpus) == (1.0, 1.0)
    with pytest.raises(ConfigError, match=r"pool prefill: num_gpus auto, but no node .*"
                       r"prefill_pool: 1.*set prefill.num_gpus"):  # fmt: skip
        place_gpus(app(prefill=pinned("prefill")), waiting)


def test_a_cpu_model_asks_for_no_gpu_and_reads_no_cluster(monkeypatch):
    def unread():
        raise AssertionError("the cluster was read")

    monkeypatch.setattr(ClusterView, "current", classmethod(lambda cls: unread()))
    placed = place_gpus(app(device="cpu"))
    assert (placed.prefill.num_gpus, placed.decode.num_gpus) == (0.0, 0.0)


def test_fractional_gpus_fit_a_node_with_one():
    config = app(prefill=PoolConfig(num_gpus=0.5), decode=PoolConfig(num_gpus=0.5))
    placed = place_gpus(config, ClusterView((CPU_HEAD, {"CPU": 8.0, "GPU": 1.0})))
    assert placed.prefill.num_gpus == 0.5
    assert engine_gpus("decode", PoolConfig(), "cuda:0", AWS) == 1.0


def test_a_colocated_app_places_its_one_pool():
    placed = place_gpus(app(mode="colocated"), ClusterView((CPU_HEAD, DECODE_NODE)))
    assert placed.decode.num_gpus == 1.0


def test_the_view_is_rays_live_nodes_when_connected(monkeypatch):
    import ray

    nodes = [
        {"Alive": True, "Resources": CPU_HEAD},
        {"Alive": False, "Resources": DECODE_NODE},  # a node that left
        {"Alive": True, "Resources": PREFILL_NODE},
    ]
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    view = ClusterView.current()
    assert view.nodes == (CPU_HEAD, PREFILL_NODE) and view.where == "the cluster"


def test_without_ray_the_view_is_this_machine(monkeypatch):
    import ray
    import torch

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(gpu_placement.os, "cpu_count", lambda: 4)
    assert ClusterView.current() == ClusterView(({"CPU": 4.0, "GPU": 2.0},), "this machine")


def test_the_dict_form_takes_auto_or_a_number_and_the_router_a_number():
    config = AppConfig.from_dict({"model": {"path": "/m"}, "prefill": {"num_gpus": 2}})
    assert (config.prefill.num_gpus, config.decode.num_gpus) == (2.0, "auto")
    assert AppConfig.from_dict(config.to_dict()) == config
    with pytest.raises(InvalidArgument, match='router.num_gpus: expected a number, got "auto"'):
        AppConfig.from_dict({"model": {"path": "/m"}, "router": {"num_gpus": "auto"}})
    with pytest.raises(InvalidArgument, match="decode.num_gpus"):
        AppConfig.from_dict({"model": {"path": "/m"}, "decode": {"num_gpus": "some"}})
    with pytest.raises(ConfigError, match="num_gpus must be >= 0"):
        PoolConfig(num_gpus=-1)
