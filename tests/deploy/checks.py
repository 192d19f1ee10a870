"""What the deploy/ tests check, shared by them: where the files are, and the checks on Serve
configs (Serve's own schema, the real app's builder and args) and on pool resources (every
deployment fits the node types, or KubeRay groups, meant for it)."""

from __future__ import annotations

import copy
import importlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.autoscaler
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.build_app import build_app
from ray.serve.schema import ServeDeploySchema

import cluster.serving.app
from cluster.serving.app import (
    GRPC_SERVICER,
    config_from_args,
    deployment_pools,
    override_conflicts,
)
from cluster.serving.app_config import AppConfig, PoolConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RAY_UP_CONFIGS = sorted(DEPLOY.glob("*/cluster.yaml"))
SERVE_CONFIGS = sorted((DEPLOY / "serve").glob("*.yaml"))
PRODUCTION = DEPLOY / "serve" / "production.yaml"
PRODUCTION_70B = DEPLOY / "serve" / "production-70b.yaml"
KUBERAY = DEPLOY / "kuberay" / "rayservice.yaml"
RAY_SCHEMA = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
# The AppConfig pool each deployment is built from (cluster/serving/app.py).
POOL_OF = {"Router": "router", "Prefill": "prefill", "Decode": "decode", "Colocated": "decode"}
ENGINE_DEPLOYMENTS = ("Prefill", "Decode", "Colocated")


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


# The config.json of meta-llama/Llama-3.1-70B-Instruct, its shape: what building an app of
# tensor-parallel pools reads (`check_tp_split`), where the file's placeholder path has nothing.
LLAMA_31_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
    "num_hidden_layers": 80, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
}  # fmt: skip
STAND_INS = {"Llama-3.1-70B-Instruct": LLAMA_31_70B}


def with_stand_in_models(raw: dict[str, Any], root: Path) -> dict[str, Any]:
    """`raw` with each application's model path that is not here and that `STAND_INS` names
    pointed at a stand-in under `root`: the checkpoint's config.json and a weight file with no
    tensors (enough to describe the model, not to load it)."""
    raw = copy.deepcopy(raw)
    for app in raw["applications"]:
        model = app["args"].get("model") or {}  # none: the builder's default
        path = Path(model.get("path", ""))
        if path.exists() or path.name not in STAND_INS:
            continue
        stand_in = root / path.name
        stand_in.mkdir(parents=True, exist_ok=True)
        (stand_in / "config.json").write_text(json.dumps(STAND_INS[path.name]))
        header = b'{"__metadata__":{}}'
        (stand_in / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
        model["path"] = str(stand_in)
    return raw


def app_config_of(args: dict[str, Any]) -> AppConfig:
    """An application's `args` as the builder reads them (no model path: the embedded one)."""
    return config_from_args(copy.deepcopy(args))


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(DEPLOY)) for p in paths]


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
    """The `deployments:` overrides and the args' pools say the same thing (what `pdserve
    serve --config` checks, `override_conflicts`, and the same again here by hand)."""
    for app in raw["applications"]:
        config = app_config_of(app["args"])
        assert not override_conflicts(config, app.get("deployments", []))
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


# -- pool resources --------------------------------------------------------------------------


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
        overrides = {dep["name"]: dep for dep in app.get("deployments", [])}
        for name, pool in deployment_pools(args).items():
            # The builder's, unless the file's `deployments:` entry replaces them.
            dep = overrides.get(name, {})
            opts = actor_options(
                dep.get("ray_actor_options") or getattr(args, pool).actor_options()
            )
            pool_resources = opts["resources"]
            assert pool_resources, f"{name} asks for no pool resource"
            if name in ENGINE_DEPLOYMENTS:
                assert opts["num_gpus"] >= 1, f"{name} runs without a GPU"
            demand = {"CPU": opts["num_cpus"], "GPU": opts["num_gpus"], **pool_resources}
            bundles = getattr(args, pool).serve_placement().get("placement_group_bundles")
            if bundles and "ray_actor_options" not in dep:
                # Tensor parallel: one bundle per rank, all on one node (STRICT_PACK).
                demand = {r: sum(b.get(r, 0) for b in bundles) for r in {*demand, *bundles[0]}}
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
