"""Build the Serve application: router -> prefill pool -> decode pool (or one colocated pool).

`build_app(args)` is a Serve application builder, so the same app comes from Python, from a
`serve run`/`serve deploy` config file (`import_path: cluster.serving.app:build_app`) and from
the CLI.
The role classes are named by import path, like Serve config files name them, so `cluster`
stays free of imports of the role packages. `compose_app` lets a Python caller substitute some
of them (the benchmarks deploy subclasses with timing probes, `benchmarks/probed_replicas.py`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application

from cluster.config import ModelConfig
from cluster.serving.app_config import AppConfig, PoolConfig

ROLE_CLASSES = {
    "Router": "router.router:Router",
    "Prefill": "prefill_worker.prefill_worker:PrefillWorker",
    "Decode": "decode_worker.decode_worker:DecodeWorker",
    "Colocated": "decode_worker.colocated_worker:ColocatedWorker",
}
# A replica being removed gets this long to finish its streams and hand over its KV leases.
GRACEFUL_SHUTDOWN_S = 30.0
GRPC_SERVICER = "router.grpc_ingress.add_generation_servicer"
# The pools whose replicas prefill, and the request router that sends a prompt back to the
# replica whose prefix cache holds its start (`PoolConfig.prefix_affinity`).
PREFILLING_ROLES = ("Prefill", "Colocated")
PREFIX_AFFINITY_ROUTER = "router.prefix_affinity:PrefixAffinityRouter"
# How Serve runs every pdserve replica. By default Serve runs a replica's methods on a second
# event loop in a thread of its own, and each streamed item then crosses threads twice more
# under the GIL that the engine thread also needs; pdserve's replica methods never block (the
# engine has its own thread), so they run on Serve's main loop. Measured with
# `serving_bench --quick` on 2 cores: 9.1 -> 5.7 ms per streamed token.
REPLICA_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
# How Serve's proxies reach the router, read by each proxy process when it starts, so it must
# be in the environment of the node's Ray (`ray start`), not of a deployment. By default a proxy
# calls the router as a Ray actor and every streamed token becomes a Ray object reported through
# the core workers of both processes; with this the proxy calls the router's replica over the
# gRPC server every Serve replica runs anyway. Measured with `serving_bench` (5 pairs each, on
# 2 cores): router 3.59 -> 2.97 and proxy 3.44 -> 2.81 ms of CPU per streamed token.
NODE_ENV_VARS = {"RAY_SERVE_PROXY_USE_GRPC": "1"}


def apply_node_env() -> dict[str, str]:
    """Put `NODE_ENV_VARS` into this process's environment, which a Ray started from here
    (`ray.init` without an address) passes to all its processes; a value already set wins.
    Returns the values in effect."""
    for key, value in NODE_ENV_VARS.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in NODE_ENV_VARS}


def build_app(args: dict[str, Any] | AppConfig | None = None) -> Application:
    """Serve builder. `args` is an `AppConfig` or its dict form (`AppConfig.to_dict()`);
    without a model path the embedded tiny model is used."""
    config = args if isinstance(args, AppConfig) else _config_from_args(dict(args or {}))
    return compose_app(config)


def compose_app(config: AppConfig, role_classes: Mapping[str, str] | None = None) -> Application:
    """The app of `config`, for Python callers. `role_classes` replaces some entries of
    `ROLE_CLASSES` (same keys, "module:Class" import paths): a subclass of the role's class
    that keeps its constructor, deployed under the role's name. Serve wants a builder of one
    parameter, hence this second function."""
    unknown = set(role_classes or {}) - set(ROLE_CLASSES)
    if unknown:
        raise ValueError(f"no such roles: {sorted(unknown)}; roles: {sorted(ROLE_CLASSES)}")
    roles = {**ROLE_CLASSES, **(role_classes or {})}
    config = config.resolved()
    router = _deployment("Router", roles["Router"], config.router)
    if config.mode == "colocated":
        colocated = _deployment("Colocated", roles["Colocated"], config.decode).bind(config)
        return router.bind(config, None, None, colocated)
    prefill = _deployment("Prefill", roles["Prefill"], config.prefill).bind(config)
    decode = _deployment("Decode", roles["Decode"], config.decode).bind(config)
    return router.bind(config, prefill, decode, None)


def _config_from_args(args: dict[str, Any]) -> AppConfig:
    model = dict(args.pop("model", None) or {})
    if not model.get("path"):
        from cluster.model.make_model import default_model_dir

        model["path"] = str(default_model_dir())
    args["model"] = model
    return AppConfig.from_dict(args)


def _deployment(name: str, import_path: str, pool: PoolConfig):
    module, _, attr = import_path.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    size = (
        {"autoscaling_config": pool.autoscaling.serve_config()}
        if pool.autoscaling is not None
        else {"num_replicas": pool.replicas}
    )
    options = pool.actor_options()
    options["runtime_env"] = {"env_vars": dict(REPLICA_ENV_VARS)}
    routing = {}
    if name in PREFILLING_ROLES and pool.prefix_affinity and pool.cache.enable_prefix_caching:
        routing["request_router_config"] = {
            "request_router_class": PREFIX_AFFINITY_ROUTER,
            "request_router_kwargs": {
                "block_size": pool.cache.block_size,
                "max_imbalance": pool.affinity_max_imbalance,
            },
        }
    return serve.deployment(
        cls,
        name=name,
        ray_actor_options=options,
        max_ongoing_requests=pool.ongoing_limit,
        max_queued_requests=pool.queued_limit,
        health_check_period_s=5,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        **size,
        **routing,
    )


def default_config(model_path: str | None = None, **overrides: Any) -> AppConfig:
    """An `AppConfig` for `model_path` (default: the embedded tiny model)."""
    if model_path is None:
        from cluster.model.make_model import default_model_dir

        model_path = str(default_model_dir())
    return AppConfig(model=ModelConfig(path=model_path), **overrides)
