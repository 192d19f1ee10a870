"""The KV pool's block count from memory (`kv_pool_blocks`): arithmetic on given figures, and an
engine that sizes its pool from `kv_cache_memory`."""

from __future__ import annotations

import pytest
import torch

from cluster.config import CacheConfig
from cluster.engine.kv_cache import CPU_KV_BLOCKS, KVLayout, kv_pool_blocks
from cluster.errors import InvalidArgument

GiB = 1 << 30
CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def layout(dtype: str = "bfloat16") -> KVLayout:
    return KVLayout("m@0", dtype, num_layers=32, num_kv_heads=8, head_dim=128, block_size=16)


def test_a_block_holds_keys_and_values_of_every_layer():
    # Llama-3.1-8B in bf16: 2 x 32 layers x 16 tokens x 8 heads x 128 dims x 2 bytes = 2 MiB.
    assert layout().block_bytes == 2 * 32 * 16 * 8 * 128 * 2 == 2 << 20
    assert layout("float32").block_bytes == 4 << 20


def test_a_gpu_pool_gets_what_the_utilization_leaves_after_use_and_activations():
    # 80 GiB card, 0.9 of it = 72 GiB; 17 GiB in use (weights), 1 GiB kept: 54 GiB of 2 MiB blocks.
    free, total = 63 * GiB, 80 * GiB
    blocks = kv_pool_blocks(CacheConfig(), 2 << 20, CUDA, 1 * GiB, memory=(free, total))
    assert blocks == int(0.9 * 80 * GiB - 17 * GiB - 1 * GiB) // (2 << 20) == 54 * 512
    lower = kv_pool_blocks(
        CacheConfig(gpu_memory_utilization=0.5), 2 << 20, CUDA, 1 * GiB, memory=(free, total)
    )
    assert lower == (40 - 17 - 1) * 512


def test_a_given_count_or_size_wins():
    memory = (63 * GiB, 80 * GiB)
    assert kv_pool_blocks(CacheConfig(num_blocks=7), 2 << 20, CUDA, 0, memory=memory) == 7
    sized = CacheConfig(kv_cache_memory="4GiB")
    assert kv_pool_blocks(sized, 2 << 20, CUDA, 0, memory=memory) == 2048
    assert kv_pool_blocks(sized, 4 << 20, CPU, 0) == 1024


def test_a_cpu_pool_without_count_or_size_keeps_the_default():
    assert kv_pool_blocks(CacheConfig(), 2 << 20, CPU, 0) == CPU_KV_BLOCKS


def test_no_room_for_a_block_is_refused_saying_why():
    with pytest.raises(InvalidArgument, match="gpu_memory_utilization 0.2 of 80.0 GiB"):
        kv_pool_blocks(
            CacheConfig(gpu_memory_utilization=0.2), 2 << 20, CUDA, GiB, memory=(63 * GiB, 80 * GiB)
        )
    with pytest.raises(InvalidArgument, match="kv_cache_memory 1000 bytes"):
        kv_pool_blocks(CacheConfig(kv_cache_memory=1000), 2 << 20, CPU, 0)


def test_an_engine_sizes_its_pool_from_kv_cache_memory(model_dir, make_engine):
    engine = make_engine(model_dir("llama-gqa"), kv_cache_memory="1MiB")
    assert engine.scheduler.blocks.num_blocks == (1 << 20) // engine.layout.block_bytes
    # and the scratch block
    assert engine.kv_cache.k.shape[1] == engine.scheduler.blocks.num_blocks + 1
    assert engine.stats().kv_blocks_total == engine.scheduler.blocks.num_blocks
