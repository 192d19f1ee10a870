"""`GrpcKVClient`'s channel bookkeeping (its fetches are tested against a real `KVServer` in
tests/prefill_worker/test_kv_server.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.errors import InvalidArgument
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient


def test_unused_channels_are_closed_once_idle_and_past_the_call_deadline() -> None:
    async def go() -> None:
        client = GrpcKVClient(1 << 20, timeout_s=1.0, idle_seconds=0.2)
        client._stub("127.0.0.1:1")
        old = client._stubs["127.0.0.1:1"][0]
        await asyncio.sleep(0.3)  # idle, but a call made at its last use could still be running
        client._stub("127.0.0.1:2")
        assert len(client) == 2
        await asyncio.sleep(0.8)  # :1 is now past both; :2 is past neither
        client._stub("127.0.0.1:3")
        assert sorted(client._stubs) == ["127.0.0.1:2", "127.0.0.1:3"]
        await asyncio.sleep(0.05)
        assert old.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        client._stub("127.0.0.1:1")  # a returning endpoint gets a fresh channel
        assert client._stubs["127.0.0.1:1"][0] is not old
        await client.close()
        assert len(client) == 0

    asyncio.run(go())


def test_channels_in_use_are_kept() -> None:
    async def go() -> None:
        client = GrpcKVClient(1 << 20, timeout_s=0.1, idle_seconds=0.1)
        for _ in range(5):
            client._stub("127.0.0.1:1")
            await asyncio.sleep(0.05)
            client._stub("127.0.0.1:2")
        assert len(client) == 2
        await client.close()

    asyncio.run(go())


def test_idle_seconds_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="idle_seconds"):
        GrpcKVClient(1 << 20, timeout_s=1.0, idle_seconds=0)
