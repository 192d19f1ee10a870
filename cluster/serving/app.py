"""Build the Serve application: router -> prefill pool -> decode pool (or one colocated pool).

`build_app(args)` is a Serve application builder, so the same app comes from Python, from a
`serve run`/`serve deploy` config file (`import_path: cluster.serving.app:build_app`) and from
the CLI.
The role classes are named by import path, like Serve config files name them, so `cluster`
stays free of imports of the role packages. `compose_app` lets a Python caller substitute some
of them (a subclass with probes of its own, say).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cluster.config import ModelConfig
from cluster.serving.app_config import AppConfig, DeploymentConfig
from cluster.serving.autoscaling import ratio_serve_policy
from cluster.serving.gpu_placement import place_gpus
from cluster.serving.hub_env import hub_env_vars

if TYPE_CHECKING:  # ray.serve is imported when an app is built, not to read a config
    from ray.serve import Application

ROLE_CLASSES = {
    "Router": "router.router:Router",
    "Prefill": "prefill_worker.prefill_worker:PrefillWorker",
    "Decode": "decode_worker.decode_worker:DecodeWorker",
    "Colocated": "decode_worker.colocated_worker:ColocatedWorker",
}
# A replica being removed gets this long to finish its streams and hand over its KV leases.
GRACEFUL_SHUTDOWN_S = 30.0
GRPC_SERVICER = "router.grpc_ingress.add_generation_servicer"
# A Serve config file's `import_path` for this builder.
BUILDER_PATH = "cluster.serving.app:build_app"
# The pools whose replicas prefill, and the request router that sends a prompt back to the
# replica whose prefix cache holds its start (`PoolConfig.prefix_affinity`).
PREFILLING_ROLES = ("Prefill", "Colocated")
PREFIX_AFFINITY_ROUTER = "router.prefix_affinity:PrefixAffinityRouter"
# How Serve runs every pdserve replica. By default Serve runs a replica's methods on a second
# event loop in a thread of its own, and each streamed item then crosses threads twice more
# under the GIL that the engine thread also needs; pdserve's replica methods never block (the
# engine has its own thread), so they run on Serve's main loop: less latency per streamed
# token (docs/findings.md). And Ray starts its
# workers at nice 15, below every process of the node at 0 (Ray's own daemons, drivers, clients
# on the host), so an engine thread gave way to all of them; pdserve's replicas keep nice 0.
# With it the decode engine thread waits less for a core and the direct path delivers more of
# the engine alone's tokens (docs/findings.md).
REPLICA_ENV_VARS = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_worker_niceness": "0"}
# The router replica's calls to the pools: Serve's handle runs its request routing on a third
# event loop in a thread of its own by default, each call crossing threads both ways; the
# router's code makes no blocking handle calls, so routing runs on its own loop: less router
# CPU a request, and less for all processes together with the pools' access log off
# (docs/findings.md).
ROUTER_ENV_VARS = {**REPLICA_ENV_VARS, "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
# Serve's access log writes a line per call to every replica's log file. For the pools those
# calls are the router's own (two a request, their errors logged anyway), a few percent of a
# pool replica's CPU per request; the router keeps the log of the calls that reach it through
# Serve's proxies.
POOL_LOGGING = {"enable_access_log": False}
# How Serve's proxies reach the router, read by each proxy process when it starts, so it must
# be in the environment of the node's Ray (`ray start`), not of a deployment. By default a proxy
# calls the router as a Ray actor and every streamed token becomes a Ray object reported through
# the core workers of both processes; with this the proxy calls the router's replica over the
# gRPC server every Serve replica runs anyway: less CPU per streamed token in both the router
# and the proxy (docs/findings.md).
# The proxy's gRPC server also takes and sends messages of at most 4 MiB (grpc's default and
# the router's direct endpoint's; Ray's own default is 2 GiB, while its hop to the router
# carries at most 4 MiB anyway): larger ones are RESOURCE_EXHAUSTED before they are read.
# And every Ray worker of the node starts at nice 0, as pdserve's replicas do: with the
# replicas at 0 and Serve's proxies and controller left at Ray's 15, a busy engine (a
# replacement replica loading, a backlog after a kill) starved the proxy, and load through
# it collapsed while the direct endpoint was unhurt (docs/findings.md).
NODE_ENV_VARS = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(4 << 20),
    "RAY_worker_niceness": "0",
}


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
    config = args if isinstance(args, AppConfig) else config_from_args(args)
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
    # Each engine pool's GPUs from the cluster's nodes; device and dtype "auto" stay for each
    # replica to decide where it runs.
    config = place_gpus(config.resolved())
    env = hub_env_vars(config.model)
    router = _deployment("Router", roles["Router"], config.router, env)
    if config.mode == "colocated":
        colocated = _deployment("Colocated", roles["Colocated"], config.decode, env).bind(config)
        return router.bind(config, None, None, colocated)
    prefill = _deployment(
        "Prefill", roles["Prefill"], config.prefill, env, ratio_policy(config, "prefill")
    ).bind(config)
    decode = _deployment(
        "Decode", roles["Decode"], config.decode, env, ratio_policy(config, "decode")
    ).bind(config)
    return router.bind(config, prefill, decode, None)


def ratio_policy(config: AppConfig, pool: str) -> dict[str, Any] | None:
    """The Serve autoscaling `policy` of engine pool `pool` under `autoscaling.ratio_policy`
    (`autoscaling.ratio_serve_policy`); None without it (the pool's own policy)."""
    ratio = config.autoscaling.ratio_policy
    settings = config.pool(pool).autoscaling
    if ratio is None or settings is None or pool not in ("prefill", "decode"):
        return None
    from cluster.serving.stats_registry import registry_name

    bounds = {}
    for name in ("prefill", "decode"):
        scaling = config.pool(name).autoscaling
        assert scaling is not None  # AppConfig checks both pools autoscale
        bounds[name] = (scaling.min_replicas, scaling.max_replicas)
    own = settings.serve_config()["policy"]
    return ratio_serve_policy(ratio, pool, own, bounds, config.name, registry_name(config.name))


def config_from_args(args: Mapping[str, Any] | None) -> AppConfig:
    """The `AppConfig` of a Serve config's `args`, strictly validated (`AppConfig.from_dict`);
    without `model.path`, the embedded tiny model."""
    if not isinstance(args, Mapping | None):
        return AppConfig.from_dict(args)  # refused: not a mapping
    args = dict(args or {})
    model = args.get("model")
    if model is None or isinstance(model, Mapping) and model.get("path") in (None, ""):
        from cluster.model.make_model import default_model_dir

        args["model"] = {**(model or {}), "path": str(default_model_dir())}
    return AppConfig.from_dict(args)


def deployment_pools(config: AppConfig) -> dict[str, str]:
    """Deployment name -> the `AppConfig` pool it is built from."""
    if config.mode == "colocated":
        return {"Router": "router", "Colocated": "decode"}
    return {"Router": "router", "Prefill": "prefill", "Decode": "decode"}


def deployment_options(
    name: str,
    pool: DeploymentConfig,
    env: Mapping[str, str] | None = None,
    policy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The options of `serve.deployment` for deployment `name`, all derived from its pool:
    size or autoscaling, Ray resources and placement (a placement group per replica at tensor
    parallel size > 1, `PoolConfig.serve_placement`), request limits, request router; `env`
    joins the replicas' env vars (a hub model's, `hub_env.hub_env_vars`); `policy` replaces
    the pool's autoscaling policy (`ratio_policy`)."""
    size: dict[str, Any] = {"num_replicas": pool.replicas}
    if pool.autoscaling is not None:
        scaling = pool.autoscaling.serve_config()
        size = {"autoscaling_config": {**scaling, "policy": policy or scaling["policy"]}}
    env_vars = {**(ROUTER_ENV_VARS if name == "Router" else REPLICA_ENV_VARS), **(env or {})}
    actor = {**pool.actor_options(), "runtime_env": {"env_vars": env_vars}}
    routing = {}
    if name in PREFILLING_ROLES and pool.prefix_affinity and pool.cache.enable_prefix_caching:
        routing["request_router_config"] = {
            "request_router_class": PREFIX_AFFINITY_ROUTER,
            "request_router_kwargs": {
                "block_size": pool.cache.block_size,
                "max_imbalance": pool.affinity_max_imbalance,
            },
        }
    return {
        "ray_actor_options": actor,
        "max_ongoing_requests": pool.ongoing_limit,
        "max_queued_requests": pool.queued_limit,
        "health_check_period_s": 5,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
        **({} if name == "Router" else {"logging_config": POOL_LOGGING}),
        **size,
        **pool.serve_placement(),
        **routing,
    }


# What `deployment_options` derives from a pool: a Serve config's `deployments:` entry that
# sets one of these is applied by Serve over the builder's, so it must say the same.
POOL_OPTIONS = (
    "ray_actor_options",
    "num_replicas",
    "autoscaling_config",
    "max_ongoing_requests",
    "max_queued_requests",
    "request_router_config",
    "max_replicas_per_node",
    "placement_group_bundles",
    "placement_group_strategy",
)


def override_conflicts(config: AppConfig, deployments: list[Mapping[str, Any]]) -> list[str]:
    """Where a Serve config's `deployments:` entries disagree with what the builder derives
    from `args` (`deployment_options`), one line each; [] when they agree. Serve cannot see
    this: it applies the entry over the builder's options and the pool silently changes."""
    pools = deployment_pools(config)
    problems = []
    for entry in deployments:
        name = entry.get("name")
        if name not in pools:
            problems.append(f"deployments: no deployment {name!r} in this app {list(pools)}")
            continue
        pool = pools[name]
        built = deployment_options(name, config.pool(pool), None, ratio_policy(config, pool))
        for option in (o for o in POOL_OPTIONS if o in entry):
            mine, theirs = entry[option], built.get(option)
            if option == "ray_actor_options":
                mine, theirs = _ray_resources(mine or {}), _ray_resources(theirs)
            if mine != theirs:
                problems.append(f"deployments[{name}].{option} is {mine}: " + (
                    f"args.{pools[name]} makes it {theirs}; set it in args.{pools[name]} only"
                    if theirs is not None
                    else f"leave it out, the pool's size and autoscaling are args.{pools[name]}'s"
                ))  # fmt: skip
    return problems


def _ray_resources(actor_options: Mapping[str, Any]) -> dict[str, Any]:
    """An actor's resource request with Serve's defaults filled in, for comparison ("auto"
    GPUs, decided when the app is built, stay "auto")."""
    gpus = actor_options.get("num_gpus", 0)
    return {
        "num_cpus": float(actor_options.get("num_cpus", 1)),
        "num_gpus": gpus if gpus == "auto" else float(gpus),
        "resources": {k: float(v) for k, v in (actor_options.get("resources") or {}).items()},
    }


def _deployment(
    name: str,
    import_path: str,
    pool: DeploymentConfig,
    env: Mapping[str, str],
    policy: dict[str, Any] | None = None,
):
    from ray import serve

    module, _, attr = import_path.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    return serve.deployment(cls, name=name, **deployment_options(name, pool, env, policy))


def default_config(model_path: str | None = None, **overrides: Any) -> AppConfig:
    """An `AppConfig` for `model_path` (default: the embedded tiny model)."""
    if model_path is None:
        from cluster.model.make_model import default_model_dir

        model_path = str(default_model_dir())
    return AppConfig(model=ModelConfig(path=model_path), **overrides)
