"""The `ray up` configs under deploy/ against the JSON schema in the installed Ray wheel
(ray/autoscaler/ray-schema.json) and Ray's own pre-launch checks, and the node environment every
Ray process needs (configs and the image). Nothing here reaches a cloud; every check is also
shown to fail on a deliberately broken copy."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

import cluster.serving.app
from tests.deploy.checks import (
    DEPLOY,
    KUBERAY,
    PRODUCTION,
    RAY_SCHEMA,
    RAY_UP_CONFIGS,
    SERVE_CONFIGS,
    ids,
    load,
    serve_config_of,
)


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
            env = command.split("ray start")[0].split()
            for var, value in cluster.serving.app.NODE_ENV_VARS.items():
                assert f"{var}={value}" in env, f"{key}: {var} not set"


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
