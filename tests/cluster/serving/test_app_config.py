"""`AppConfig.engine_config`: each pool's engine gets its own slice of the app's config."""

from __future__ import annotations

import pytest

from cluster.config import CacheConfig, ModelConfig
from cluster.errors import InvalidArgument
from cluster.serving.app_config import AppConfig, PoolConfig


def app(cuda_graphs: bool) -> AppConfig:
    return AppConfig(
        ModelConfig("/models/m", device="cuda", dtype="bfloat16", cuda_graphs=cuda_graphs),
        prefill=PoolConfig(cache=CacheConfig(num_blocks=64)),
        decode=PoolConfig(cache=CacheConfig(num_blocks=256)),
    )


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_a_prefill_engine_captures_no_cuda_graphs(cuda_graphs: bool) -> None:
    # Its requests are prefill_only: it never runs a decode step to replay a graph for.
    prefill = app(cuda_graphs).engine_config("prefill")

    assert prefill.model.cuda_graphs is False
    assert prefill.cache.num_blocks == 64
    assert prefill.model == ModelConfig(
        "/models/m", device="cuda", dtype="bfloat16", cuda_graphs=False
    )


@pytest.mark.parametrize("pool", ["decode", "colocated"])
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_decode_and_colocated_engines_keep_the_configs_cuda_graphs(
    pool: str, cuda_graphs: bool
) -> None:
    config = app(cuda_graphs)
    engine = config.engine_config(pool)

    assert engine.model is config.model
    assert engine.model.cuda_graphs is cuda_graphs
    assert engine.cache.num_blocks == 256


@pytest.mark.parametrize(
    "setting, device, on",
    [
        (None, "cpu", False),  # default: the text on the engine thread, after its step
        (None, "cuda", True),
        (None, "cuda:1", True),
        (True, "cpu", True),
        (False, "cuda:0", False),
    ],
)
def test_an_output_thread_by_default_only_on_a_gpu(setting, device: str, on: bool) -> None:
    assert PoolConfig(output_thread=setting).output_thread_on(device) is on


def test_output_thread_takes_booleans_or_null_only() -> None:
    model = {"path": "/models/m"}
    decode = AppConfig.from_dict({"model": model, "decode": {"output_thread": True}}).decode
    assert decode.output_thread is True
    assert AppConfig.from_dict({"model": model}).decode.output_thread is None
    with pytest.raises(InvalidArgument, match="output_thread"):
        AppConfig.from_dict({"model": model, "decode": {"output_thread": "yes"}})
