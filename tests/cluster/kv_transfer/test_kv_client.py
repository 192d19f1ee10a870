"""`make_kv_client` picks one `KVClient` per transport, once."""

from __future__ import annotations

import asyncio

import torch

from cluster.config import TransferConfig
from cluster.kv_transfer.collective_kv_client import CollectiveKVClient
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_client import KVClient, make_kv_client


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
