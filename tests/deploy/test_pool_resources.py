"""The GPU deployments' per-pool resource requests against what their node types provide: the
`ray up` GPU clusters' node types and the KubeRay manifest's worker groups (whose embedded Serve
config must be deploy/serve/production.yaml). Every check is also shown to fail on a broken
copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml

from tests.deploy.checks import (
    DEPLOY,
    KUBERAY,
    PRODUCTION,
    RAY_UP_CONFIGS,
    NodeType,
    check_args_agree,
    check_pools_fit,
    check_serve_config,
    ids,
    load,
    ray_up_node_types,
    serve_config_of,
)

GPU_CLUSTERS = [
    p
    for p in RAY_UP_CONFIGS
    if any(t["resources"].get("GPU") for t in load(p)["available_node_types"].values())
]


@pytest.mark.parametrize("path", GPU_CLUSTERS, ids=ids(GPU_CLUSTERS))
def test_gpu_cluster_provides_every_pool_resource_and_the_head_none(path: Path):
    config = load(path)
    check_pools_fit(load(serve_config_of(config)), *ray_up_node_types(config))


def _break_head_provides_pool(serve, cluster_config):
    cluster_config["available_node_types"]["head"]["resources"]["prefill_pool"] = 1


def _break_unprovided_resource(serve, cluster_config):
    serve["applications"][0]["args"]["decode"]["resources"] = {"decode": 1}


def _break_too_few_nodes(serve, cluster_config):
    cluster_config["available_node_types"]["decode_gpu"]["max_workers"] = 1


def _break_pool_on_two_types(serve, cluster_config):
    cluster_config["available_node_types"]["decode_gpu"]["resources"]["prefill_pool"] = 8


@pytest.mark.parametrize(
    "breakage",
    [
        _break_head_provides_pool,
        _break_unprovided_resource,
        _break_too_few_nodes,
        _break_pool_on_two_types,
    ],
)
def test_resource_check_fails_on_a_broken_copy(breakage):
    config = load(DEPLOY / "aws" / "cluster.yaml")
    serve = load(serve_config_of(config))
    breakage(serve, config)
    with pytest.raises(AssertionError):
        check_pools_fit(serve, *ray_up_node_types(config))


# -- KubeRay ----------------------------------------------------------------------------------


def rayservice() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(KUBERAY.read_text()) if d]
    assert len(docs) == 1
    (doc,) = docs
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    return doc


def group_node_type(name: str, group: dict[str, Any], max_count: int) -> NodeType:
    """A KubeRay group as the autoscaler sees it: CPU and GPU from the container's limits
    (or rayStartParams), custom resources from rayStartParams."""
    params = group["rayStartParams"]
    (container,) = group["template"]["spec"]["containers"]
    limits = container.get("resources", {}).get("limits", {})
    resources = {"CPU": float(params.get("num-cpus", limits.get("cpu", 0)))}
    resources["GPU"] = float(params.get("num-gpus", limits.get("nvidia.com/gpu", 0)))
    if "resources" in params:
        # KubeRay's format: a JSON string literal holding the JSON object.
        resources.update(json.loads(json.loads(params["resources"])))
    return NodeType(name, resources, max_count)


def test_kuberay_manifest_embeds_the_production_serve_config():
    spec = rayservice()["spec"]
    embedded = yaml.safe_load(spec["serveConfigV2"])
    check_serve_config(embedded)
    check_args_agree(embedded)
    assert embedded == load(PRODUCTION), "serveConfigV2 drifted from deploy/serve/production.yaml"


def test_kuberay_groups_provide_every_pool_resource_and_expose_grpc_and_http():
    spec = rayservice()["spec"]
    cluster_spec = spec["rayClusterConfig"]
    assert cluster_spec["rayVersion"] == ray.__version__
    head_group = cluster_spec["headGroupSpec"]
    head = group_node_type("head", head_group, 1)
    groups = {g["groupName"]: g for g in cluster_spec["workerGroupSpecs"]}
    assert {"prefill", "decode"} <= set(groups)
    workers = [group_node_type(n, g, g["maxReplicas"]) for n, g in groups.items()]
    check_pools_fit(yaml.safe_load(spec["serveConfigV2"]), head, workers)

    service_ports = {p["port"] for p in spec["serveService"]["spec"]["ports"]}
    (head_container,) = head_group["template"]["spec"]["containers"]
    container_ports = {p["containerPort"] for p in head_container["ports"]}
    assert {8000, 9000} <= service_ports and {8000, 9000} <= container_ports
