"""deploy/serve/production-70b.yaml: Llama-3.1-70B at tensor parallel size 4 in both pools. Its
replicas (4 ranks' bundles on one node) fit the node types of deploy/aws/cluster.yaml and the
KubeRay manifest's groups; the checkpoint's shape splits over 4 ranks; and the KV pools it
states fit each GPU beside the weights, with the figures its comments and docs/deployment.md
give."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.config import ConfigError
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_config import check_tp_split
from tests.deploy.checks import (
    DEPLOY,
    LLAMA_31_70B,
    PRODUCTION_70B,
    app_config_of,
    check_pools_fit,
    load,
    ray_up_node_types,
    with_stand_in_models,
)
from tests.deploy.test_pool_resources import group_node_type, rayservice

GIB = 2**30
BF16 = 2
# What each GPU may hold: its memory as CUDA reports it (H100 "80 GB": 81559 MiB; H200 "141
# GB": 143771 MiB) times the pool's gpu_memory_utilization, less room for activations.
GPU_GIB = {"prefill": 81559 / 1024, "decode": 143771 / 1024}
ACTIVATIONS_GIB = 4.0


def _params(c: dict) -> int:
    """Llama's parameter count from its config: embeddings and LM head (untied), per layer
    q, k, v, o, gate, up, down and two norms, and the final norm."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 2 * v * h + c["num_hidden_layers"] * layer + h


def _config(tmp_path) -> AppConfig:
    (app,) = with_stand_in_models(load(PRODUCTION_70B), tmp_path)["applications"]
    return app_config_of(app["args"])


def test_the_70b_replicas_fit_the_gpu_node_types_and_kuberay_groups():
    raw = load(PRODUCTION_70B)
    check_pools_fit(raw, *ray_up_node_types(load(DEPLOY / "aws" / "cluster.yaml")))
    cluster_spec = rayservice()["spec"]["rayClusterConfig"]
    head = group_node_type("head", cluster_spec["headGroupSpec"], 1)
    groups = [
        group_node_type(g["groupName"], g, g["maxReplicas"])
        for g in cluster_spec["workerGroupSpecs"]
    ]
    check_pools_fit(raw, head, groups)


def test_a_tp_replicas_cpus_count_on_one_node():
    """The check counts every rank's bundle: 4 ranks of 8 CPUs is 32 on one node."""
    raw = load(PRODUCTION_70B)
    head, workers = ray_up_node_types(load(DEPLOY / "aws" / "cluster.yaml"))
    for node in workers:
        node.resources["CPU"] = min(node.resources["CPU"], 24.0)
    with pytest.raises(AssertionError, match="no node type has room for one Prefill replica"):
        check_pools_fit(raw, head, workers)


def test_llama_70b_splits_over_4_ranks_in_both_pools(tmp_path):
    config = _config(tmp_path)
    assert (config.prefill.tensor_parallel_size, config.decode.tensor_parallel_size) == (4, 4)
    check_tp_split(config.model, 4, 4)
    assert (
        config.prefill.serve_placement()["placement_group_bundles"]
        == [{"CPU": 8.0, "GPU": 1.0, "prefill_pool": 1.0}] + [{"CPU": 8.0, "GPU": 1.0}] * 3
    )
    with pytest.raises(ConfigError, match="KV moves between TP sizes"):  # TP 8: not offered
        replace(config, decode=replace(config.decode, tensor_parallel_size=8))


@pytest.mark.parametrize(
    "pool, blocks, tokens, total_gib",
    [("prefill", 16384, 262_144, 52.9), ("decode", 65536, 1_048_576, 112.9)],
)
def test_each_gpu_holds_its_weights_and_kv_pool(tmp_path, pool, blocks, tokens, total_gib):
    c = LLAMA_31_70B
    params = _params(c)
    assert round(params / 1e9, 1) == 70.6 and round(params * BF16 / 1e9) == 141
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    kv_per_token = c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * 2 * BF16
    assert kv_per_token == 320 * 1024
    engine = getattr(_config(tmp_path), pool)
    k, cache = engine.tensor_parallel_size, engine.cache
    assert (cache.num_blocks, cache.num_blocks * cache.block_size) == (blocks, tokens)
    # Each rank holds 1/k of the weights and the KV of its 8/k KV heads.
    per_gpu = params * BF16 / k + cache.num_blocks * cache.block_size * kv_per_token / k
    assert round(per_gpu / GIB, 1) == total_gib
    room = GPU_GIB[pool] * cache.gpu_memory_utilization - ACTIVATIONS_GIB
    assert per_gpu / GIB <= room, f"{pool}: {per_gpu / GIB:.1f} GiB a GPU, room {room:.1f}"
