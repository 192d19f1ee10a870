"""Each deployment's Serve options are derived from its pool in `args` alone (stated once), and a
Serve config's `deployments:` entry that says otherwise is found, naming the option and the
pool (`override_conflicts`, which `pdserve serve --config` refuses on)."""

from __future__ import annotations

import pytest

from cluster.serving.app import (
    build_app,
    config_from_args,
    deployment_options,
    deployment_pools,
    override_conflicts,
)
from cluster.serving.app_config import AppConfig

ARGS = {
    "model": {"path": "/models/m"},
    "router": {"num_cpus": 2, "resources": {"router_pool": 1}, "max_ongoing_requests": 512},
    "prefill": {
        "num_cpus": 8,
        "num_gpus": 1,
        "resources": {"prefill_pool": 1},
        "max_ongoing_requests": 64,
        "autoscaling": {"min_replicas": 1, "max_replicas": 4},
    },
    "decode": {"replicas": 2, "num_cpus": 8, "num_gpus": 1, "resources": {"decode_pool": 1}},
}


def built_deployments(config: AppConfig) -> dict:
    app = build_app(config)
    pools = [a for a in app._bound_deployment.init_args if hasattr(a, "_bound_deployment")]
    return {d.name: d for d in [app._bound_deployment, *(a._bound_deployment for a in pools)]}


def test_the_built_deployments_take_their_resources_and_size_from_args():
    config = config_from_args(ARGS)
    built = built_deployments(config)
    assert set(built) == set(deployment_pools(config)) == {"Router", "Prefill", "Decode"}
    prefill = built["Prefill"]
    assert prefill.ray_actor_options["num_gpus"] == 1
    assert prefill.ray_actor_options["resources"] == {"prefill_pool": 1.0}
    assert prefill.max_ongoing_requests == 64
    assert prefill._deployment_config.autoscaling_config.max_replicas == 4
    assert built["Decode"].num_replicas == 2
    assert built["Router"].ray_actor_options["num_cpus"] == 2
    for name, pool in deployment_pools(config).items():
        options = deployment_options(name, getattr(config, pool))
        assert built[name].ray_actor_options == options["ray_actor_options"]


def test_entries_that_agree_with_args_or_set_only_serves_own_options_pass():
    config = config_from_args(ARGS)
    entries = [
        {"name": "Router", "max_ongoing_requests": 512, "health_check_period_s": 10},
        # Serve's defaults filled in: num_gpus 0 and no resources say the same as args.
        {"name": "Decode", "num_replicas": 2, "ray_actor_options": {
            "num_cpus": 8.0, "num_gpus": 1, "resources": {"decode_pool": 1}}},
        {"name": "Prefill", "graceful_shutdown_timeout_s": 60},
    ]  # fmt: skip
    assert override_conflicts(config, entries) == []


@pytest.mark.parametrize(
    "entry, words",
    [
        (
            {"name": "Prefill", "ray_actor_options": {"num_cpus": 8, "num_gpus": 0}},
            ["deployments[Prefill].ray_actor_options", "args.prefill"],
        ),
        ({"name": "Decode", "max_ongoing_requests": 64}, ["deployments[Decode]", "128"]),
        ({"name": "Prefill", "num_replicas": 2}, ["num_replicas is 2", "leave it out"]),
        ({"name": "Decode", "autoscaling_config": {"max_replicas": 2}}, ["leave it out"]),
        ({"name": "PrefillWorker"}, ["no deployment 'PrefillWorker'"]),
        ({"name": "Colocated", "num_replicas": 1}, ["no deployment 'Colocated'"]),
    ],
)
def test_an_entry_that_disagrees_with_args_is_named(entry, words):
    (problem,) = override_conflicts(config_from_args(ARGS), [entry])
    for word in words:
        assert word in problem


def test_without_a_model_path_the_builder_serves_the_embedded_model():
    from cluster.model.make_model import default_model_dir

    config = config_from_args({"model": {"dtype": "float32"}, "name": "x"})
    assert config.model.path == str(default_model_dir()) and config.name == "x"
    assert config_from_args(None).model.path == config.model.path


def test_a_fixed_router_grpc_port_puts_one_router_replica_per_node():
    """Two router replicas on one node would both bind the port: a fixed port spreads them
    (Serve's max_replicas_per_node); the default, a free port each, places them anywhere."""
    fixed = config_from_args({**ARGS, "router": {"replicas": 3, "grpc_port": 9100}})
    assert (fixed.router.direct_grpc, fixed.router.grpc_port) == (True, 9100)
    assert deployment_options("Router", fixed.router)["max_replicas_per_node"] == 1
    assert "max_replicas_per_node" not in deployment_options("Prefill", fixed.prefill)
    free = config_from_args({**ARGS, "router": {"replicas": 3}})
    assert (free.router.direct_grpc, free.router.grpc_port) == (True, 0)
    assert "max_replicas_per_node" not in deployment_options("Router", free.router)
    entry = {"name": "Router", "max_replicas_per_node": 2}
    (problem,) = override_conflicts(fixed, [entry])
    assert "deployments[Router].max_replicas_per_node is 2" in problem


def test_a_router_pool_built_in_python_gets_the_direct_endpoint_defaults():
    from dataclasses import replace

    from cluster.config import ModelConfig
    from cluster.serving.app_config import PoolConfig, RouterConfig

    config = AppConfig(model=ModelConfig(path="m"), router=PoolConfig(replicas=2, num_cpus=0.25))
    assert isinstance(config.router, RouterConfig)
    assert (config.router.replicas, config.router.num_cpus) == (2, 0.25)
    assert (config.router.direct_grpc, config.router.grpc_port) == (True, 0)
    off = replace(config, router=replace(config.router, direct_grpc=False))
    assert AppConfig.from_dict(off.to_dict()) == off


def test_the_router_routes_on_its_own_loop_and_the_pools_keep_no_access_log():
    """The router replica's handle calls route on its own event loop (no thread of Serve's in
    between); the pools' replicas, whose calls are all the router's, log none of them."""
    config = config_from_args(ARGS)
    built = built_deployments(config)
    router_env = built["Router"].ray_actor_options["runtime_env"]["env_vars"]
    assert router_env["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert router_env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"
    assert built["Router"]._deployment_config.logging_config is None
    for name in ("Prefill", "Decode"):
        env = built[name].ray_actor_options["runtime_env"]["env_vars"]
        assert "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP" not in env
        assert built[name]._deployment_config.logging_config["enable_access_log"] is False
    for name in ("Router", "Prefill", "Decode"):  # not Ray's nice 15 for workers
        env = built[name].ray_actor_options["runtime_env"]["env_vars"]
        assert env["RAY_worker_niceness"] == "0"
