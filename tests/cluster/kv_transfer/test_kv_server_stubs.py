"""`KVServerStubs`' channel bookkeeping (the calls on them are tested against a real `KVServer`
in tests/prefill_worker/)."""

from __future__ import annotations

import asyncio

import grpc

from cluster.kv_transfer.kv_server_stubs import KVServerStubs


def test_unused_channels_are_closed_once_idle_and_past_the_call_deadline() -> None:
    async def go() -> None:
        stubs = KVServerStubs(1 << 20, timeout_s=1.0, idle_seconds=0.2)
        stubs.stub("127.0.0.1:1")
        old = stubs._stubs["127.0.0.1:1"][0]
        await asyncio.sleep(0.3)  # idle, but a call made at its last use could still be running
        stubs.stub("127.0.0.1:2")
        assert len(stubs) == 2
        await asyncio.sleep(0.8)  # :1 is now past both; :2 is past neither
        stubs.fetch_kv("127.0.0.1:3")
        assert sorted(stubs._stubs) == ["127.0.0.1:2", "127.0.0.1:3"]
        await asyncio.sleep(0.05)
        assert old.get_state() == grpc.ChannelConnectivity.SHUTDOWN
        stubs.stub("127.0.0.1:1")  # a returning endpoint gets a fresh channel
        assert stubs._stubs["127.0.0.1:1"][0] is not old
        await stubs.close()
        assert len(stubs) == 0

    asyncio.run(go())


def test_channels_in_use_are_kept() -> None:
    async def go() -> None:
        stubs = KVServerStubs(1 << 20, timeout_s=0.1, idle_seconds=0.1)
        for _ in range(5):
            stubs.stub("127.0.0.1:1")
            await asyncio.sleep(0.05)
            stubs.stub("127.0.0.1:2")
        assert len(stubs) == 2
        await stubs.close()

    asyncio.run(go())
