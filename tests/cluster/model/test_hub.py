"""A model named by hub id is resolved through `huggingface_hub`'s own cache lookup, from a
cache the test lays out with the project's checkpoint writer (HF_HUB_OFFLINE: no network), and
loaded by the engine with the same tokens as the checkpoint's directory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.engine import Engine
from cluster.errors import InvalidArgument
from cluster.model.hub import checkpoint_dir, is_hub_id, pinned
from cluster.model.info import describe_model
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.cluster.model.hub_cache import REPO_ID, make_hub_cache, use_hub_cache


@pytest.fixture
def snapshot(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    use_hub_cache(monkeypatch, home, offline=True)
    return make_hub_cache(home / "hub")


def test_a_hub_id_resolves_to_its_cached_snapshot_and_pins_the_commit(snapshot):
    model = ModelConfig(REPO_ID)
    assert is_hub_id(REPO_ID) and not is_hub_id(str(snapshot))
    assert checkpoint_dir(model) == snapshot
    assert model.served_name == REPO_ID  # clients call it by the hub id, not the hash
    fixed = pinned(model)
    assert fixed.revision == snapshot.name and fixed.path == REPO_ID
    assert checkpoint_dir(fixed) == snapshot  # the commit, looked up without refs/main
    assert describe_model(model).model_id.startswith(f"{REPO_ID}@")


def test_the_engine_loads_a_hub_id_and_generates_as_from_the_directory(snapshot):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = tuple(range(40, 52))
    out = {}
    for name, path in (("hub", REPO_ID), ("dir", str(snapshot))):
        config = EngineConfig(ModelConfig(path), CacheConfig(num_blocks=32))
        engine = Engine(config)
        (result,) = engine.generate([Request(name, prompt, params)])
        out[name] = list(result.token_ids)
        assert engine.scheduler.blocks.num_used == 0
    assert len(out["hub"]) == 8 and out["hub"] == out["dir"]


def test_a_revision_selects_that_snapshot(snapshot, tmp_path):
    other = make_hub_cache(tmp_path / "hf" / "hub", seed=1)  # refs/main now names this one
    assert checkpoint_dir(ModelConfig(REPO_ID)) == other
    assert checkpoint_dir(ModelConfig(REPO_ID, revision=snapshot.name)) == snapshot


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/nope/model", "model /nope/model: no such directory"),
        ("pdserve-test/absent", "not in the Hugging Face cache"),
        ("./relative-absent", "no such directory"),
    ],
)
def test_a_missing_model_is_one_line_naming_it(snapshot, path, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        checkpoint_dir(ModelConfig(path))
    assert "\n" not in e.value.message
    if "/" in path and not path.startswith(("/", ".")):
        assert "HF_HUB_OFFLINE" in e.value.message


def test_a_custom_served_name_survives_resolution(snapshot):
    model = ModelConfig(REPO_ID, served_name="my-model")
    assert replace(pinned(model), device="cpu").served_name == "my-model"
