"""A hub id on a cluster: the machine that builds the app pins the revision to the hub's commit
id and reads at most config and tokenizer files (never weights); each replica downloads the
weights into its own node's cache when its engine loads. The hub is `FakeHub` (no network)."""

from __future__ import annotations

import pytest

from cluster.cli.engine_flags import check_model
from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.engine import Engine
from cluster.errors import InvalidArgument
from cluster.model.hub import CONFIG_FILES, checkpoint_dir, pinned
from cluster.model.info import describe_model
from cluster.model.make_model import make_model
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.cluster.model.hub_cache import REPO_ID, FakeHub, hub_error, make_hub_cache, use_hub_cache


@pytest.fixture
def source(tmp_path):
    return make_model("tiny", tmp_path / "source", seed=3)


@pytest.fixture
def online(tmp_path, monkeypatch, source):
    """An empty cache, and the hub reachable (a fake)."""
    home = tmp_path / "hf"
    use_hub_cache(monkeypatch, home, offline=False)
    return FakeHub(monkeypatch, home / "hub", source)


def test_the_builder_pins_the_hubs_commit_without_downloading(online):
    model = pinned(ModelConfig(REPO_ID, revision="v1"))
    assert model.revision == online.commit and model.path == REPO_ID
    assert online.info_calls == [(REPO_ID, "v1")]
    assert online.downloads == []  # no file at all: the commit comes from the hub's answer
    assert pinned(model) == model and len(online.info_calls) == 1  # a commit id is no lookup


def test_the_builders_check_reads_config_and_tokenizer_only(online, source):
    model = check_model(ModelConfig(REPO_ID))
    assert model.revision == online.commit
    assert online.downloads == [CONFIG_FILES] and not online.weights_downloaded()
    snapshot = online.hub_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots"
    fetched = {p.name for p in (snapshot / online.commit).iterdir()}
    assert "config.json" in fetched and "tokenizer.json" in fetched
    assert not [f for f in fetched if f.endswith(".safetensors")]
    # The router's description is the same, from the same files: identity = the commit.
    assert describe_model(model).model_id == f"{REPO_ID}@{online.commit[:12]}"
    assert not online.weights_downloaded()


def test_a_replica_downloads_the_weights_into_its_cache_and_generates(online, source):
    model = check_model(ModelConfig(REPO_ID))  # the builder: config files in this cache
    assert not online.weights_downloaded()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = {}
    for name, m in (("hub", model), ("dir", ModelConfig(str(source)))):
        engine = Engine(EngineConfig(m, CacheConfig(num_blocks=32)))  # what a replica runs
        (result,) = engine.generate([Request(name, tuple(range(30, 40)), params)])
        out[name] = list(result.token_ids)
    # The partial snapshot the builder left on this node was not taken for the checkpoint.
    assert online.downloads == [CONFIG_FILES, CONFIG_FILES + ["*.safetensors"]]
    assert len(out["hub"]) == 6 and out["hub"] == out["dir"]


def test_offline_the_commit_is_the_cached_snapshots(tmp_path, monkeypatch, source):
    home = tmp_path / "hf"
    use_hub_cache(monkeypatch, home, offline=True)
    hub = FakeHub(monkeypatch, home / "hub", source)
    snapshot = make_hub_cache(home / "hub")
    assert pinned(ModelConfig(REPO_ID)).revision == snapshot.name
    assert hub.info_calls == [] and hub.downloads == []


def test_an_unreachable_hub_falls_back_to_the_cache(online):
    online.info_error = ConnectionError("Name or service not known")
    snapshot = make_hub_cache(online.hub_cache)
    assert pinned(ModelConfig(REPO_ID)).revision == snapshot.name
    with pytest.raises(InvalidArgument, match="the hub is out of reach: Name or service") as e:
        pinned(ModelConfig("pdserve-test/absent"))
    assert "\n" not in e.value.message and online.downloads == []


def test_a_builder_offline_with_config_only_cached_tells_the_replica_has_no_weights(
    tmp_path, monkeypatch, online
):
    model = check_model(ModelConfig(REPO_ID))  # config files only, in this cache
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InvalidArgument, match="has no weights of it while HF_HUB_OFFLINE"):
        checkpoint_dir(model)


@pytest.mark.parametrize(
    ("error", "message"),
    [
        ("RepositoryNotFoundError", "no such repository on the hub"),
        ("GatedRepoError", "gated: log in \\(HF_TOKEN\\)"),
        ("RevisionNotFoundError", "no such revision"),
    ],
)
def test_the_hubs_refusals_are_one_line(online, error, message):
    import huggingface_hub.errors

    online.info_error = hub_error(getattr(huggingface_hub.errors, error))
    with pytest.raises(InvalidArgument, match=message) as e:
        pinned(ModelConfig(REPO_ID, revision="v9"))
    assert e.value.message.startswith(f"model {REPO_ID}@v9: ") and "\n" not in e.value.message


def test_a_repository_without_safetensors_is_refused_before_any_download(online, source):
    for f in source.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(InvalidArgument, match="no safetensors weights"):
        pinned(ModelConfig(REPO_ID))
    assert online.downloads == []
