"""The Serve configs under deploy/ against `ServeDeploySchema`, the builder they name and the
deployments it builds, and their `deployments:` overrides against the args' pools. Every check
is also shown to fail on a deliberately broken copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.errors import InvalidArgument
from tests.deploy.checks import (
    PRODUCTION,
    SERVE_CONFIGS,
    check_args_agree,
    check_serve_config,
    ids,
    load,
    with_stand_in_models,
)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=ids(SERVE_CONFIGS))
def test_serve_config_passes_serves_schema_and_builds_the_app(path: Path, tmp_path: Path):
    raw = with_stand_in_models(load(path), tmp_path)  # a TP app's build reads the checkpoint
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


# What the Decode entry would say if it restated the pool's resources (the file states them
# once, in args).
DECODE_ACTOR = {"num_cpus": 8, "num_gpus": 1, "resources": {"decode_pool": 1}}


def test_args_check_fails_without_the_replica_env_vars():
    """An entry's ray_actor_options replace the builder's runtime_env with them: the app's
    runtime_env must bring the replica settings back."""
    broken = load(PRODUCTION)
    broken["applications"][0]["deployments"][2]["ray_actor_options"] = dict(DECODE_ACTOR)
    check_args_agree(broken)
    del broken["applications"][0]["runtime_env"]
    with pytest.raises(AssertionError, match="env"):
        check_args_agree(broken)


def test_args_check_fails_when_pools_disagree():
    broken = load(PRODUCTION)
    broken["applications"][0]["deployments"][2]["ray_actor_options"] = dict(DECODE_ACTOR)
    broken["applications"][0]["args"]["decode"]["resources"] = {"prefill_pool": 1}
    with pytest.raises(AssertionError):
        check_args_agree(broken)


@pytest.mark.parametrize("override", [{"num_replicas": 2}, {"autoscaling_config": {}}])
def test_args_check_fails_when_a_deployment_entry_overrides_pool_autoscaling(override):
    broken = load(PRODUCTION)
    broken["applications"][0]["deployments"][1].update(override)  # Prefill
    with pytest.raises(AssertionError):
        check_args_agree(broken)
