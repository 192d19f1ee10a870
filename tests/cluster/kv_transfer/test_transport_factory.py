"""`make_kv_client` picks one `KVClient` per transport, once."""

from __future__ import annotations

import asyncio

import torch

from cluster.config import TransferConfig
from cluster.kv_transfer.base import KVClient
from cluster.kv_transfer.collective.collective_kv_client import CollectiveKVClient
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.transport_factory import make_kv_client


def test_each_transport_gets_its_client_behind_the_one_interface() -> None:
    cpu = torch.device("cpu")
    grpc_client = make_kv_client(TransferConfig(transport="grpc"), cpu, max_blocks=8)
    gloo_client = make_kv_client(TransferConfig(transport="gloo"), cpu, max_blocks=8)
    assert type(grpc_client) is GrpcKVClient and type(gloo_client) is CollectiveKVClient
    assert isinstance(grpc_client, KVClient) and isinstance(gloo_client, KVClient)
    assert not isinstance(gloo_client, GrpcKVClient)  # it holds one for its control calls
    assert gloo_client.max_blocks == grpc_client.max_blocks == 8
    asyncio.run(grpc_client.close())
    asyncio.run(gloo_client.close())


def test_nixl_registers_the_decode_pool_and_grpc_checksums_only_when_asked() -> None:
    from cluster.engine.kv_cache import KVCache, KVLayout
    from cluster.kv_transfer.nixl.nixl_kv_client import NixlKVClient

    cpu = torch.device("cpu")
    layout = KVLayout("m", "float32", 2, 2, 8, 16)
    pool = KVCache(layout, 4, torch.float32, cpu)
    nixl_client = make_kv_client(TransferConfig(transport="nixl"), cpu, max_blocks=4, pool=pool)
    # the whole pool tensor: its 4 blocks and the scratch block after them
    assert type(nixl_client) is NixlKVClient and nixl_client.region.num_blocks == 5
    assert nixl_client.region.mem_type == "DRAM"
    asyncio.run(nixl_client.close())
    plain = make_kv_client(TransferConfig(transport="grpc"), cpu, max_blocks=8)
    checked = make_kv_client(TransferConfig(transport="grpc", checksum=True), cpu, max_blocks=8)
    assert not plain.checksum and checked.checksum
    asyncio.run(plain.close())
    asyncio.run(checked.close())


def test_auto_is_nixl_where_two_agents_reach_each_other(monkeypatch) -> None:
    from cluster.kv_transfer.nixl import nixl_pool
    from cluster.serving.app_config import auto_transport

    assert nixl_pool.probe() == ""
    assert auto_transport("disaggregated") == "nixl"
    assert auto_transport("colocated") == "grpc"
    monkeypatch.setattr(nixl_pool, "probe", lambda: "no UCX here")
    assert auto_transport("disaggregated") == "grpc"
