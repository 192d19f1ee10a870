"""deploy/serve/local-cpu.yaml boots the real app on a real local Ray, as the file says.

The file goes through `pdserve serve --config`'s own path (`_deploy_config_file`, which does
what `serve run FILE` does) into the session's Serve, whose proxies already listen on free
ports (the file's ports cannot be re-applied to a running Serve). `ray_serve` comes from the
plugin tests/conftest.py registers; importing it here too would start a second Ray. The oracle
for the greedy tokens is pdserve's engine in this process, on the same embedded checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.config import EngineConfig, ModelConfig
from cluster.engine.engine import Engine
from cluster.model.make_model import default_model_dir
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.ray_fixtures import app_metadata, stub, wait_for_idle

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "serve" / "local-cpu.yaml"
PROMPT = tuple(range(40, 61))
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def raw_config() -> dict:
    return yaml.safe_load(LOCAL.read_text())


@pytest.fixture(scope="module")
def local_app(ray_serve, raw_config):
    from ray import serve

    from cluster.cli.serve import _deploy_config_file

    (app,) = raw_config["applications"]
    _deploy_config_file(LOCAL, timeout_s=300)
    yield app["name"]
    serve.delete(app["name"])


def test_local_cpu_config_serves_greedy_tokens_equal_to_the_engine(ray_serve, local_app):
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling)
    msgs = list(stub(ray_serve).Generate(request, metadata=app_metadata(local_app)))
    got = [t for m in msgs for t in m.token_ids]

    engine = Engine(EngineConfig(ModelConfig(str(default_model_dir()))))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    (want,) = engine.generate([Request("oracle", PROMPT, params)])

    assert got == list(want.token_ids)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == MAX_TOKENS
    wait_for_idle(ray_serve, local_app, {"prefill", "decode"})


def test_the_files_deployments_overrides_are_applied(local_app, raw_config):
    """Deployed from the config (declaratively, as `serve run FILE`), with the file's
    per-deployment options over what the builder set."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()["applications"][local_app]
    assert details["source"] == "declarative"
    (app,) = raw_config["applications"]
    for override in app["deployments"]:
        live = details["deployments"][override["name"]]["deployment_config"]
        for option, value in override.items():
            if option == "ray_actor_options":
                for key, v in value.items():
                    assert live["ray_actor_options"][key] == v, (override["name"], key)
            elif option != "name":
                assert live[option] == value, (override["name"], option)
