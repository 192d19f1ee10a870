"""Device and dtype "auto" are decided by each engine replica where it runs (`on_replica`): cuda +
bfloat16 where torch sees a GPU and Ray granted the replica one, else cpu + float32, with the
token budget for that device. CUDA's presence and Ray's grant are faked; the replica reports what
it decided in its stats (`GetStats`, `pdserve status`)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import ray
import torch

from cluster.config import CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS, EngineConfig, ModelConfig
from cluster.serving import replica_device
from cluster.serving.app_config import AppConfig
from cluster.serving.metered_engine import MeteredEngine
from cluster.serving.pool_messages import RankPlace
from cluster.serving.replica import _ENGINE_FIGURES, EngineReplica, rank_places
from cluster.serving.replica_device import on_replica, ray_granted_gpus


def auto_engine(**model) -> EngineConfig:
    config = AppConfig(ModelConfig("/models/m", **{"device": "auto", "dtype": "auto", **model}))
    return config.resolved().engine_config("decode")


@pytest.fixture
def cuda(monkeypatch):
    """`cuda(seen, granted)`: torch sees a GPU or not; Ray granted the actor `granted` GPUs
    (None: not in a Ray actor)."""

    def fake(seen: bool, granted: int | None = None) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: seen)
        monkeypatch.setattr(replica_device, "ray_granted_gpus", lambda: granted)

    return fake


def test_a_replica_that_sees_a_gpu_runs_cuda_in_bfloat16(cuda):
    cuda(True)
    config = on_replica(auto_engine())
    assert (config.model.device, config.model.dtype) == ("cuda", "bfloat16")
    assert config.scheduler.max_num_batched_tokens == GPU_BATCHED_TOKENS


def test_a_replica_without_a_gpu_runs_the_cpu_in_float32(cuda):
    cuda(False, granted=1)
    config = on_replica(auto_engine())
    assert (config.model.device, config.model.dtype) == ("cpu", "float32")
    assert config.scheduler.max_num_batched_tokens == CPU_BATCHED_TOKENS


def test_a_gpu_node_replica_that_ray_granted_no_gpu_stays_on_the_cpu(cuda):
    cuda(True, granted=0)  # Ray leaves CUDA_VISIBLE_DEVICES alone for it: torch sees them all
    assert on_replica(auto_engine()).model.device == "cpu"
    cuda(True, granted=1)
    assert on_replica(auto_engine()).model.device == "cuda"


def test_explicit_choices_stay(cuda):
    cuda(True, granted=0)
    config = on_replica(auto_engine(device="cuda"))
    assert (config.model.device, config.model.dtype) == ("cuda", "bfloat16")
    cuda(False)
    config = on_replica(auto_engine(dtype="float16"))
    assert (config.model.device, config.model.dtype) == ("cpu", "float16")


def test_rays_grant_is_read_only_in_an_actor(monkeypatch):
    context = SimpleNamespace(
        get_actor_id=lambda: "a1", get_accelerator_ids=lambda: {"GPU": ["0"], "neuron_cores": []}
    )
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)
    assert ray_granted_gpus() == 1
    context.get_accelerator_ids = lambda: {"GPU": []}
    assert ray_granted_gpus() == 0
    context.get_actor_id = lambda: None  # a driver: Ray decides nothing for it
    assert ray_granted_gpus() is None
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert ray_granted_gpus() is None


def test_the_engine_is_built_on_what_the_replica_decided(cuda, tokenizer_model_dir):
    cuda(False)
    config = AppConfig(ModelConfig(str(tokenizer_model_dir), device="auto", dtype="auto"))
    engine = MeteredEngine(on_replica(config.resolved().engine_config("prefill")))
    assert str(engine.device) == "cpu" and engine.kv_cache.k.dtype == torch.float32


def test_the_replicas_stats_carry_its_device_dtype_and_tp_size():
    replica = object.__new__(EngineReplica)
    replica.pool, replica.replica_id = "decode", "d0"
    replica.device, replica.dtype = "cuda", "bfloat16"
    replica.tensor_parallel_size = 2
    replica.ranks = rank_places(
        SimpleNamespace(followers=[SimpleNamespace(pid=4242, node_id="", node_ip="")])
    )
    figures = SimpleNamespace(**dict.fromkeys(_ENGINE_FIGURES, 0))

    async def call(fn):
        return fn(SimpleNamespace(stats=lambda: figures))

    replica.engine = SimpleNamespace(call=call)
    stats = asyncio.run(replica.stats())
    assert (stats.pool, stats.device, stats.dtype) == ("decode", "cuda", "bfloat16")
    assert stats.tensor_parallel_size == 2
    # Outside Ray no node is known; rank 0 is this process, rank 1 the follower it started.
    assert stats.ranks == (RankPlace(0, "", "", os.getpid()), RankPlace(1, "", "", 4242))
