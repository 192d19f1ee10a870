"""An app that serves a hub id gives every replica the builder's hub token and cluster-wide hub
settings in its runtime env (so each node downloads with them), and nothing else of the
builder's hub environment; the token shows in no config, repr, log line or printed output."""

from __future__ import annotations

import json
import logging

import pytest

from cluster.config import ModelConfig
from cluster.serving.app import compose_app, default_config
from cluster.serving.hub_env import hub_env_vars
from tests.cluster.model.hub_cache import REPO_ID, make_hub_cache, use_hub_cache

TOKEN = "hf_pdserveTestTokenNotReal0123456789"


def test_a_hub_id_gets_the_token_and_shared_settings_but_not_the_cache_path():
    environ = {
        "HF_TOKEN": TOKEN,
        "HF_ENDPOINT": "https://mirror.example",
        "HF_HOME": "/home/builder/.cache/huggingface",
        "HF_HUB_CACHE": "/home/builder/.cache/huggingface/hub",
    }
    assert hub_env_vars(ModelConfig(REPO_ID), environ) == {
        "HF_TOKEN": TOKEN,
        "HF_ENDPOINT": "https://mirror.example",
    }
    assert hub_env_vars(ModelConfig("/models/llama"), environ) == {}  # a directory: nothing


def test_a_stored_login_is_the_token_when_the_environment_has_none(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: TOKEN)
    assert hub_env_vars(ModelConfig(REPO_ID), {"HF_HUB_OFFLINE": "1"}) == {
        "HF_HUB_OFFLINE": "1",
        "HF_TOKEN": TOKEN,
    }
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert hub_env_vars(ModelConfig(REPO_ID), {}) == {}


def _deployments(app) -> dict:
    """Deployment name -> `ray_actor_options`, over the app's whole graph."""
    found, todo = {}, [app]
    while todo:
        d = todo.pop()._bound_deployment
        found[d.name] = d.ray_actor_options
        todo += [a for a in d.init_args if hasattr(a, "_bound_deployment")]
    return found


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_every_replica_of_a_hub_app_carries_the_token_and_nothing_prints_it(
    tmp_path, monkeypatch, caplog, capsys, mode
):
    use_hub_cache(monkeypatch, tmp_path / "hf", offline=True)
    make_hub_cache(tmp_path / "hf" / "hub")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    config = default_config(REPO_ID, mode=mode)
    caplog.set_level(logging.DEBUG)
    app = compose_app(config)
    options = _deployments(app)
    expected = {"Router", "Colocated"} if mode == "colocated" else {"Router", "Prefill", "Decode"}
    assert set(options) == expected
    for name, actor in options.items():
        env = actor["runtime_env"]["env_vars"]
        assert env["HF_TOKEN"] == TOKEN and env["HF_HUB_OFFLINE"] == "1", name
        assert "HF_HOME" not in env and "HF_HUB_CACHE" not in env
        assert env["RAY_worker_niceness"] == "0"  # the replicas' own settings stay
    resolved = config.resolved()
    shown = [repr(config), repr(resolved), json.dumps(resolved.to_dict()), caplog.text]
    shown += list(capsys.readouterr())
    assert not [s for s in shown if TOKEN in s]


def test_a_local_model_app_passes_no_hub_environment(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    options = _deployments(compose_app(default_config()))
    assert not [n for n, a in options.items() if "HF_TOKEN" in a["runtime_env"]["env_vars"]]
