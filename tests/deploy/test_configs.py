"""The files under deploy/ against the schemas Ray itself ships, and against the real app.

Nothing here reaches a cloud. `ray up` configs are checked against the JSON schema in the
installed Ray wheel (ray/autoscaler/ray-schema.json) and Ray's own pre-launch checks; Serve
configs against `ServeDeploySchema`, the builder they name and the deployments it builds; the GPU
configs' per-pool resource requests against what their node types (or KubeRay worker groups)
provide. Every check is also shown to fail on a deliberately broken copy.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.build_app import build_app
from ray.serve.schema import ServeDeploySchema

import cluster.serving.app
from cluster.errors import InvalidArgument
from cluster.serving.app import GRPC_SERVICER, _config_from_args
from cluster.serving.app_config import AppConfig, PoolConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_UP_CONFIGS = sorted(DEPLOY.glob("*/cluster.yaml"))
SERVE_CONFIGS = sorted((DEPLOY / "serve").glob("*.yaml"))
PRODUCTION = DEPLOY / "serve" / "production.yaml"
KUBERAY = DEPLOY / "kuberay" / "rayservice.yaml"
RAY_SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
# The AppConfig pool each deployment is built from (cluster/serving/app.py).
POOL_OF = {"Router": "router", "Prefill": "prefill", "Decode": "decode", "Colocated": "decode"}
ENGINE_DEPLOYMENTS = ("Prefill", "Decode", "Colocated")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def app_config_of(args: dict[str, Any]) -> AppConfig:
    """An application's `args` as the builder reads them (no model path: the embedded one)."""
    return _config_from_args(copy.deepcopy(args))


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(DEPLOY)) for p in paths]


def test_deploy_holds_the_expected_files():
    assert DEPLOY / "aws" / "cluster.yaml" in RAY_UP_CONFIGS
    assert {PRODUCTION, DEPLOY / "serve" / "local-cpu.yaml"} <= set(SERVE_CONFIGS)
    assert KUBERAY.is_file()


# -- `ray up` configs ------------------------------------------------------------------------


def check_ray_up(config: dict[str, Any]) -> None:
    """What `ray up` checks before it launches anything: the wheel's JSON schema, then Ray's own
    validation of the config merged with the provider's defaults."""
    jsonschema.Draft7Validator(json.loads(RAY_SCHEMA.read_text())).validate(config)
    validate_config(prepare_config(copy.deepcopy(config)))


@pytest.mark.parametrize("path", RAY_UP_CONFIGS, ids=ids(RAY_UP_CONFIGS))
def test_ray_up_config_passes_rays_schema(path: Path):
    config = load(path)
    check_ray_up(config)
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"].get("CPU") == 0, "the head node must run no replicas"
    setup = " ".join(config["setup_commands"])
    assert "torch" in setup and "~/pdserve" in setup, "setup must install torch and pdserve"
    pinned = re.search(r"ray\[[\w,]+\]==([\w.]+)", setup)
    assert pinned and pinned.group(1) == ray.__version__, "pin the Ray version tests ran on"
    start = " ".join(config["head_start_ray_commands"])
    for flag in ("--head", "--dashboard-host", "--metrics-export-port"):
        assert flag in start
    assert serve_config_of(config).is_file()
    check_node_env(config)


def check_node_env(config: dict[str, Any]) -> None:
    """Every `ray start` of every node sets cluster.serving.app.NODE_ENV_VARS (proxies read it)."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[key] if "ray start" in c]
        assert starts, f"{key}: no ray start"
        for command in starts:
            for var, value in cluster.serving.app.NODE_ENV_VARS.items():
                assert f"{var}={value} ray start" in command, f"{key}: {var} not set"


def test_node_env_check_fails_when_a_worker_starts_without_it():
    broken = load(DEPLOY / "aws" / "cluster.yaml")
    broken["worker_start_ray_commands"] = [
        c.replace("RAY_SERVE_PROXY_USE_GRPC=1 ", "") for c in broken["worker_start_ray_commands"]
    ]
    with pytest.raises(AssertionError, match="worker_start_ray_commands"):
        check_node_env(broken)


def test_the_image_sets_the_node_env_for_every_ray_process():
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    for var, value in cluster.serving.app.NODE_ENV_VARS.items():
        assert re.search(rf"^ENV {var}={value}$", dockerfile, re.M), var


def _break_resource(c):
    c["available_node_types"]["prefill_gpu"]["resources"]["prefill_pool"] = 0.5


def _break_node_type_key(c):
    c["available_node_types"]["decode_gpu"]["min_worker"] = 1


def _break_top_level_key(c):
    c["head_start_ray_command"] = c.pop("head_start_ray_commands")


def _break_provider(c):
    del c["provider"]["type"]


def _break_head_type(c):
    c["head_node_type"] = "ray.head.default"


@pytest.mark.parametrize(
    "breakage",
    [
        _break_resource,
        _break_node_type_key,
        _break_top_level_key,
        _break_provider,
        _break_head_type,
    ],
)
def test_ray_up_check_fails_on_a_broken_copy(breakage, tmp_path):
    broken = load(DEPLOY / "aws" / "cluster.yaml")
    breakage(broken)
    copy_path = tmp_path / "cluster.yaml"
    copy_path.write_text(yaml.safe_dump(broken))
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        check_ray_up(load(copy_path))


def serve_config_of(cluster_config: dict[str, Any]) -> Path:
    """The Serve config file a cluster's head start commands deploy."""
    found = re.search(
        r"deploy/serve/[\w.-]+\.yaml", " ".join(cluster_config["head_start_ray_commands"])
    )
    assert found, "the head start commands must deploy a Serve config from deploy/serve/"
    return DEPLOY.parent / found.group(0)


# -- Serve configs ---------------------------------------------------------------------------


def unknown_keys(raw: Any, parsed: Any, where: str = "") -> list[str]:
    """Keys of `raw` that Serve's schema dropped. Most Serve schema models ignore unknown
    fields (forward compatibility), so a misspelt option would otherwise vanish silently."""
    if isinstance(raw, dict) and isinstance(parsed, dict):
        missing = [f"{where}.{k}" for k in raw if k not in parsed]
        return missing + [
            m for k in raw if k in parsed for m in unknown_keys(raw[k], parsed[k], f"{where}.{k}")
        ]
    if isinstance(raw, list) and isinstance(parsed, list):
        return [
            m
            for i, (a, b) in enumerate(zip(raw, parsed, strict=True))
            for m in unknown_keys(a, b, f"{where}[{i}]")
        ]
    return []


def check_serve_config(raw: dict[str, Any]) -> ServeDeploySchema:
    """Serve's own schema, no option it would ignore, and every application resolving to the
    real pdserve app: the builder, its args as an AppConfig, the deployments it builds."""
    config = ServeDeploySchema.model_validate(raw)
    dropped = unknown_keys(raw, config.model_dump(exclude_unset=True))
    assert not dropped, f"options Serve does not know (ignored): {dropped}"
    assert GRPC_SERVICER in config.grpc_options.grpc_servicer_functions
    module, _, attr = GRPC_SERVICER.rpartition(".")
    assert callable(getattr(importlib.import_module(module), attr))
    for app in config.applications:
        module, _, attr = app.import_path.partition(":")
        builder = getattr(importlib.import_module(module), attr)
        assert builder is cluster.serving.app.build_app
        app_config = app_config_of(app.args)
        # Each application's stats registry is named after `args.name`.
        assert app_config.name == app.name
        built = build_app(
            call_user_app_builder_with_args_if_necessary(builder, app.args), name=app.name
        )
        assert built.ingress_deployment_name == "Router"
        names = {d.name for d in built.deployments}
        overridden = [d.name for d in app.deployments]
        assert set(overridden) <= names, f"{overridden} not all in the built app's {sorted(names)}"
    return config


def actor_options(options: dict[str, Any]) -> dict[str, Any]:
    """`ray_actor_options` with Ray's defaults filled in, for comparison."""
    return {
        "num_cpus": float(options.get("num_cpus", 1)),
        "num_gpus": float(options.get("num_gpus", 0)),
        "resources": {k: float(v) for k, v in (options.get("resources") or {}).items()},
    }


def check_args_agree(raw: dict[str, Any]) -> None:
    """The `deployments:` overrides and the args' pools say the same thing."""
    for app in raw["applications"]:
        config = app_config_of(app["args"])
        app_env = (app.get("runtime_env") or {}).get("env_vars") or {}
        for dep in app.get("deployments", []):
            pool = getattr(config, POOL_OF[dep["name"]])
            where = f"{app['name']}/{dep['name']}"
            if "ray_actor_options" in dep:
                got = actor_options(dep["ray_actor_options"])
                assert got == actor_options(pool.actor_options()), where
                # Serve replaces the code's ray_actor_options, runtime_env included; the
                # app's runtime_env (merged into every deployment's) must bring the replica
                # settings back.
                dep_env = (dep["ray_actor_options"].get("runtime_env") or {}).get("env_vars")
                env = {**app_env, **(dep_env or {})}
                assert env.items() >= cluster.serving.app.REPLICA_ENV_VARS.items(), f"{where}: env"
            if "max_ongoing_requests" in dep:
                assert dep["max_ongoing_requests"] == pool.ongoing_limit, where
            scaling = dep.get("autoscaling_config")
            # Serve replaces the code's autoscaling_config as a whole: an override here would
            # drop the pool's own load policy.
            assert not ("autoscaling_config" in dep and pool.autoscaling), f"{where}: set twice"
            # A fixed num_replicas would switch the pool's autoscaling off.
            assert not ("num_replicas" in dep and pool.autoscaling), f"{where}: fixed size"
            replicas = (
                (scaling.get("initial_replicas") or scaling["min_replicas"]) if scaling else None
            )
            replicas = dep.get("num_replicas", replicas)
            if replicas is not None:
                assert replicas == pool.replicas, where


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=ids(SERVE_CONFIGS))
def test_serve_config_passes_serves_schema_and_builds_the_app(path: Path):
    raw = load(path)
    check_serve_config(raw)
    check_args_agree(raw)


def _break_option_name(c):
    c["applications"][0]["deployments"][0]["health_check_period"] = 10


def _break_deployment_name(c):
    c["applications"][0]["deployments"][1]["name"] = "PrefillWorker"


def _break_import_path(c):
    c["applications"][0]["import_path"] = "cluster.serving.app:build_ap"


def _break_args(c):
    c["applications"][0]["args"]["prefill"]["gpus"] = 1


@pytest.mark.parametrize(
    "breakage",
    [
        _break_option_name,
        _break_deployment_name,
        _break_import_path,
        _break_args,
    ],
)
def test_serve_check_fails_on_a_broken_copy(breakage):
    broken = load(PRODUCTION)
    breakage(broken)
    with pytest.raises((AssertionError, ValueError, AttributeError, InvalidArgument)):
        check_serve_config(broken)


def test_args_check_fails_without_the_replica_env_vars():
    broken = load(PRODUCTION)
    del broken["applications"][0]["runtime_env"]
    with pytest.raises(AssertionError, match="env"):
        check_args_agree(broken)


def test_args_check_fails_when_pools_disagree():
    broken = load(PRODUCTION)
    broken["applications"][0]["args"]["decode"]["resources"] = {"prefill_pool": 1}
    with pytest.raises(AssertionError):
        check_args_agree(broken)


@pytest.mark.parametrize("override", [{"num_replicas": 2}, {"autoscaling_config": {}}])
def test_args_check_fails_when_a_deployment_entry_overrides_pool_autoscaling(override):
    broken = load(PRODUCTION)
    broken["applications"][0]["deployments"][1].update(override)  # Prefill
    with pytest.raises(AssertionError):
        check_args_agree(broken)


# -- GPU resources: every pool lands on its own node type, none on the head -----------------


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict[str, float]
    max_count: int


def ray_up_node_types(config: dict[str, Any]) -> tuple[NodeType, list[NodeType]]:
    types = config["available_node_types"]
    head = NodeType("head", types[config["head_node_type"]]["resources"], 1)
    workers = [
        NodeType(name, t["resources"], t.get("max_workers", config["max_workers"]))
        for name, t in types.items()
        if name != config["head_node_type"]
    ]
    return head, workers


def max_replicas(dep: dict[str, Any], pool: PoolConfig) -> int:
    """The most replicas a deployment may reach: the file's override, else the args' pool."""
    if dep.get("autoscaling_config"):
        return dep["autoscaling_config"]["max_replicas"]
    if "num_replicas" in dep:
        return dep["num_replicas"]
    return pool.autoscaling.max_replicas if pool.autoscaling else pool.replicas


def check_pools_fit(raw_serve: dict[str, Any], head: NodeType, workers: list[NodeType]) -> None:
    """Every deployment asks for a custom resource; exactly one worker type provides it (so it
    pins the pool), has room for one replica's whole request, and at its maximum node count for
    the deployment's maximum replica count; the head provides none, and no CPU either."""
    assert head.resources.get("CPU", 0) == 0 and head.resources.get("GPU", 0) == 0
    for app in raw_serve["applications"]:
        args = app_config_of(app["args"])
        assert args.model.device.startswith("cuda")
        for dep in app["deployments"]:
            name = dep["name"]
            opts = actor_options(dep["ray_actor_options"])
            pool_resources = opts["resources"]
            assert pool_resources, f"{name} asks for no pool resource"
            if name in ENGINE_DEPLOYMENTS:
                assert opts["num_gpus"] >= 1, f"{name} runs without a GPU"
            demand = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **pool_resources}
            demand = {r: v for r, v in demand.items() if v > 0}
            for r in pool_resources:
                assert r not in head.resources, f"the head provides {r}"
                providers = [n.name for n in workers if n.resources.get(r, 0) > 0]
                assert len(providers) == 1, f"{r} must come from one node type, not {providers}"
            fits = [
                n for n in workers if all(n.resources.get(r, 0) >= v for r, v in demand.items())
            ]
            assert fits, f"no node type has room for one {name} replica: {demand}"
            most = max_replicas(dep, getattr(args, POOL_OF[name]))
            room = sum(
                n.max_count * min(math.floor(n.resources[r] / v) for r, v in demand.items())
                for n in fits
            )
            assert room >= most, f"{name}: max {most} replicas, room for {room}"


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
    serve["applications"][0]["deployments"][2]["ray_actor_options"]["resources"] = {"decode": 1}


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


# -- KubeRay -----------------------------------------------------------------------------------


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
