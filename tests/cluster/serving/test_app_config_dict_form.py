"""`AppConfig`'s dict form (a Serve config's `args`) is validated strictly: each mistake is
refused with INVALID_ARGUMENT naming its field path, its JSON schema accepts the deploy/ files
and refuses what `from_dict` refuses, and the dict form round-trips."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml

from cluster.errors import InvalidArgument
from cluster.serving.app_config import AppConfig, app_config_schema
from cluster.serving.autoscaling import ENGINE_SIGNALS, SIGNALS, AutoscalingSettings
from cluster.serving.replica import EngineReplica

SERVE_CONFIGS = sorted((Path(__file__).resolve().parents[3] / "deploy" / "serve").glob("*.yaml"))
MODEL = {"path": "/models/m"}


def refusal(args: dict) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as caught:
        AppConfig.from_dict({"model": MODEL, **args})
    return caught.value


@pytest.mark.parametrize(
    "args, message",
    [
        # The issue's four.
        (
            {"prefill": {"cache": {"num_blocks": "1024"}}},
            'prefill.cache.num_blocks: expected an integer, got "1024"',
        ),
        ({"prefill": {"replicas": 2.5}}, "prefill.replicas: expected an integer, got 2.5"),
        (
            {"prefill": {"prefix_affinity": "no"}},
            'prefill.prefix_affinity: expected true or false, got "no"',
        ),
        (
            {"prefill": {"autoscaling": {"targets": {"queued_tokens": 100}}}},
            "prefill.autoscaling.targets.queued_tokens: unknown key, expected "
            "'queued_prompt_tokens', 'running', 'kv_usage' or 'requests'",
        ),
        # Unknown keys, with the likely one.
        ({"prefill": {"cahce": {}}}, "prefill.cahce: unknown key (did you mean 'cache'?)"),
        ({"decode": {"scheduler": {"max_seqs": 8}}}, "decode.scheduler.max_seqs: unknown key"),
        ({"prefil": {}}, "prefil: unknown key (did you mean 'prefill'?)"),
        # Other types.
        ({"decode": {"num_cpus": True}}, "decode.num_cpus: expected a number, got true"),
        (
            {"decode": {"resources": {"gpu": "1"}}},
            'decode.resources.gpu: expected a number, got "1"',
        ),
        ({"decode": {"autoscaling": 3}}, "decode.autoscaling: expected a mapping, got 3"),
        ({"transfer": {"transport": "tcp"}}, "transfer.transport: expected 'auto', 'grpc'"),
        ({"mode": "both"}, "mode: expected 'disaggregated' or 'colocated'"),
        (
            {"transfer": {"lease_seconds": float("inf")}},
            "transfer.lease_seconds: expected a finite",
        ),
        # Values the dataclasses' own checks refuse, at the part that refused them.
        ({"decode": {"cache": {"num_blocks": 0}}}, "decode.cache: num_blocks must be positive"),
        ({"decode": {"engine_cpus": "2-x"}}, "decode.engine_cpus: not a cpu list: '2-x'"),
        (
            {"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
            "decode.autoscaling: need 0 <= min_replicas <= max_replicas",
        ),
        (
            {"router": {"autoscaling": {"targets": {"running": 4}}}},
            "router.autoscaling.targets: ['running'] are engine signals",
        ),
        # The router's direct gRPC endpoint (RouterConfig).
        ({"router": {"grpc_port": "9100"}}, 'router.grpc_port: expected an integer, got "9100"'),
        ({"router": {"grpc_port": 70000}}, "router: grpc_port must be in 0..65535, got 70000"),
        (
            {"router": {"grpc_port": 9100, "direct_grpc": False}},
            "router: grpc_port is set but direct_grpc is off",
        ),
        ({"prefill": {"grpc_port": 9100}}, "prefill.grpc_port: unknown key"),
        # YAML can write what JSON cannot.
        ({"name": datetime.date(2025, 1, 1)}, "name: date is not a config value"),
    ],
)
def test_a_mistake_is_refused_naming_its_field_path(args, message):
    err = refusal(args)
    assert message in err.message
    assert err.grpc_code == "INVALID_ARGUMENT"


def test_every_mistake_is_listed_and_the_first_path_is_the_param():
    err = refusal({"prefill": {"replicas": "2", "cache": {"block_size": 16.0}}, "nmae": "x"})
    assert err.message.count(";") == 2, err.message
    for path in ("prefill.replicas", "prefill.cache.block_size", "nmae"):
        assert path in err.message
    assert err.param == "prefill.replicas"
    assert refusal({"prefill": {"autoscaling": {"targets": {"x": 1}}}}).param == (
        "prefill.autoscaling.targets.x"
    )


def test_a_model_path_is_required_and_the_top_must_be_a_mapping():
    with pytest.raises(InvalidArgument, match="model: required"):
        AppConfig.from_dict({})
    with pytest.raises(InvalidArgument, match="AppConfig: expected a mapping"):
        AppConfig.from_dict(["model"])


def test_built_in_python_an_unknown_signal_is_refused_too():
    with pytest.raises(InvalidArgument, match="queued_tokens"):
        AutoscalingSettings(targets=(("queued_tokens", 100.0),))


def test_the_signals_a_target_may_name_are_those_the_replicas_report():
    stats = SimpleNamespace(queued_prompt_tokens=3, running=2, kv_blocks_used=1, kv_blocks_total=4)
    reported = EngineReplica.record_autoscaling_stats(SimpleNamespace(last_stats=stats))
    assert set(reported) == set(ENGINE_SIGNALS)
    assert set(SIGNALS) == {*ENGINE_SIGNALS, "requests"}  # + Serve's own count


def test_the_dict_form_round_trips_in_plain_json_types():
    given = {
        "model": {"path": "/m", "dtype": "bfloat16", "device": "cuda", "max_model_len": 4096},
        "router": {"replicas": 2, "num_cpus": 2, "resources": {"router_pool": 1}},
        "prefill": {
            "engine_cpus": "2-3",
            "autoscaling": {"max_replicas": 4, "targets": {"queued_prompt_tokens": 4096}},
            "cache": {"num_blocks": 64},
        },
        "decode": {"engine_cpus": [5, 4], "prefix_affinity": False},
        "transfer": {"transport": "grpc", "host": "auto", "checksum": True},
        "max_migrations": 0,
    }
    config = AppConfig.from_dict(given)
    assert config.router.resources == (("router_pool", 1.0),)
    assert config.prefill.engine_cpus == (2, 3) and config.decode.engine_cpus == (4, 5)
    assert config.prefill.autoscaling.targets == (("queued_prompt_tokens", 4096.0),)
    dumped = config.to_dict()
    text = json.dumps(dumped, allow_nan=False)
    assert AppConfig.from_dict(json.loads(text)) == config
    assert dumped["router"]["resources"] == {"router_pool": 1.0}
    assert dumped["prefill"]["autoscaling"]["targets"] == {"queued_prompt_tokens": 4096.0}
    assert dumped["decode"]["engine_cpus"] == [4, 5]


def test_the_schema_accepts_the_deploy_files_and_refuses_the_issues_mistakes():
    schema = app_config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert SERVE_CONFIGS
    for path in SERVE_CONFIGS:
        for app in yaml.safe_load(path.read_text())["applications"]:
            validator.validate(app["args"])  # local-cpu.yaml has no model: allowed
    for bad in (
        {"prefill": {"cache": {"num_blocks": "1024"}}},
        {"prefill": {"replicas": 2.5}},
        {"prefill": {"prefix_affinity": "no"}},
        {"prefill": {"autoscaling": {"targets": {"queued_tokens": 100}}}},
        {"prefill": {"cahce": {}}},
    ):
        assert not validator.is_valid(bad), bad
    pool = schema["$defs"]["PoolConfig"]["properties"]
    assert pool["resources"]["default"] == {}  # a mapping in the dict form
