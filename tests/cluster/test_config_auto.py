"""`device`/`dtype` "auto", the token budget by device, sizes in bytes and the served name. "auto"
is decided where the engine runs, never by the process that builds the app (`AppConfig.resolved`
leaves it; each replica decides: tests/cluster/serving/test_replica_device.py)."""

from __future__ import annotations

import pytest
import torch

from cluster.config import (
    CPU_BATCHED_TOKENS,
    GPU_BATCHED_TOKENS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    TransferConfig,
    byte_size,
)
from cluster.serving.app_config import AppConfig


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_picks_cuda_and_bfloat16_when_cuda_is_present(gpu):
    model = ModelConfig("/m", device="auto", dtype="auto").on_device()
    assert (model.device, model.dtype) == ("cuda", "bfloat16")
    assert model.torch_dtype == torch.bfloat16


def test_auto_picks_cpu_and_float32_without_a_gpu(no_gpu):
    model = ModelConfig("/m", device="auto", dtype="auto").on_device()
    assert (model.device, model.dtype) == ("cpu", "float32")


def test_an_explicit_choice_stays_and_auto_dtype_follows_the_device(no_gpu):
    assert ModelConfig("/m", device="cuda:1", dtype="auto").on_device().dtype == "bfloat16"
    assert ModelConfig("/m", device="auto", dtype="float16").on_device().dtype == "float16"
    concrete = ModelConfig("/m", device="cpu", dtype="float32")
    assert concrete.on_device() is concrete


def test_the_token_budget_is_sized_by_the_device_unless_given():
    assert SchedulerConfig().for_device("cuda").max_num_batched_tokens == GPU_BATCHED_TOKENS
    assert GPU_BATCHED_TOKENS >= 8192
    assert SchedulerConfig().for_device("cpu").max_num_batched_tokens == CPU_BATCHED_TOKENS == 512
    given = SchedulerConfig(max_num_batched_tokens=64)
    assert given.for_device("cuda") is given
    with pytest.raises(ConfigError):
        SchedulerConfig(max_num_batched_tokens=0)


def test_the_app_leaves_auto_for_the_replicas_even_where_it_is_built_on_a_gpu(gpu):
    config = AppConfig(
        ModelConfig("/models/m", device="auto", dtype="auto"),
        transfer=TransferConfig(transport="grpc"),
    )
    resolved = config.resolved()
    assert (resolved.model.device, resolved.model.dtype) == ("auto", "auto")
    for pool in ("prefill", "decode"):
        engine = resolved.engine_config(pool)
        assert engine.scheduler.max_num_batched_tokens is None  # decided with the device
        assert engine.resolved().model.device == "cuda"  # where the engine is made
    assert resolved.model.path == "/models/m"  # a local path is left for the engine nodes


def test_an_explicit_device_gets_its_token_budget_when_the_app_is_built(no_gpu):
    config = AppConfig(ModelConfig("/m", device="cuda"), transfer=TransferConfig(transport="grpc"))
    for pool in ("prefill", "decode"):
        budget = config.resolved().engine_config(pool).scheduler.max_num_batched_tokens
        assert budget == GPU_BATCHED_TOKENS
    assert SchedulerConfig().for_device("auto").max_num_batched_tokens is None


def test_the_caller_may_say_whether_there_is_a_gpu(no_gpu):
    model = ModelConfig("/m", device="auto", dtype="auto")
    assert (model.on_device(cuda=True).device, model.on_device(cuda=True).dtype) == (
        "cuda", "bfloat16"
    )  # fmt: skip
    assert model.on_device(cuda=False).dtype == "float32"
    assert ModelConfig("/m", device="cpu", dtype="auto").on_device(cuda=True).device == "cpu"


def test_an_engine_config_resolves_by_itself(no_gpu):
    config = EngineConfig(ModelConfig("/m", device="auto", dtype="auto")).resolved()
    assert config.model.device == "cpu" and config.scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    ("text", "want"),
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2G", 2 * 10**9), ("1e9", 10**9), (4096, 4096)],
)
def test_sizes_are_read_in_bytes_with_units(text, want):
    assert byte_size(text) == want
    assert CacheConfig(kv_cache_memory=text).kv_cache_memory == want


@pytest.mark.parametrize("bad", ["lots", "-1", "4XB", True, -5])
def test_a_bad_size_is_refused(bad):
    with pytest.raises(ConfigError, match="size in bytes"):
        byte_size(bad)


def test_the_dict_form_takes_a_size_string_and_refuses_a_bad_one():
    config = AppConfig.from_dict(
        {"model": {"path": "/m"}, "decode": {"cache": {"kv_cache_memory": "1GiB"}}}
    )
    assert config.decode.cache.kv_cache_memory == 1 << 30
    with pytest.raises(Exception, match="decode.cache.kv_cache_memory"):
        AppConfig.from_dict(
            {"model": {"path": "/m"}, "decode": {"cache": {"kv_cache_memory": "x"}}}
        )


def test_the_served_name_is_the_hub_id_or_the_directory_name(tmp_path):
    assert ModelConfig("meta-llama/Llama-3.1-8B-Instruct").served_name == (
        "meta-llama/Llama-3.1-8B-Instruct"
    )
    assert ModelConfig(str(tmp_path / "tiny-v1")).served_name == "tiny-v1"
    assert ModelConfig("/m", served_name="chat").served_name == "chat"
    round_trip = AppConfig.from_dict(AppConfig(ModelConfig("org/name")).to_dict())
    assert round_trip.model.served_name == "org/name"
