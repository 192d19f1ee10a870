"""The `nixl` pair of the tests in this folder: a real KVServer (its `NixlKVSender`, the prefill
pool registered with a NIXL agent) on loopback in front of a real prefill engine, and a
`NixlKVClient` with the decode engine's pool registered with another agent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.engine.async_engine import AsyncEngine
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.nixl.nixl_kv_client import NixlKVClient
from cluster.kv_transfer.nixl.nixl_kv_sender import NixlKVSender
from cluster.request import Request
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper
from tests.cluster.kv_transfer.kv_pair import MAX_CHUNK_BYTES, PARAMS, Pair, make_engine


@dataclass
class NixlPair(Pair):
    client: NixlKVClient

    async def prefill_handle(self, rid: str, ids: tuple[int, ...]) -> KVHandle:
        return replace(await super().prefill_handle(rid, ids), transport="nixl")

    async def fetch_and_decode(self, handle: KVHandle, ids: tuple[int, ...]) -> list[int]:
        """As the decode worker does: reserve blocks, READ into them, release, decode."""
        rid, first = handle.request_id, handle.first_token_id
        request = Request(rid, ids, PARAMS)
        block_ids = await self.decode.call(lambda e: e.reserve_import(request))
        try:
            await self.client.fetch_into(handle, self.decode.kv_pool, block_ids)
        except BaseException:
            await self.decode.call(lambda e: e.cancel_import(rid))
            raise
        assert await self.client.release(handle, "fetched")
        tokens = [first]
        async for out in await self.decode._stream(rid, lambda e: e.finish_import(rid, first)):
            tokens.extend(out.token_ids)
        return tokens


@asynccontextmanager
async def nixl_pair(
    path: Path, lease_seconds: float = 30.0, expiry_interval: float | None = None
) -> AsyncIterator[NixlPair]:
    prefill, decode = AsyncEngine(make_engine(path)), AsyncEngine(make_engine(path))
    prefill.start()
    decode.start()
    leases = LeaseKeeper(prefill, lease_seconds, Capability(b"test-secret"))
    if expiry_interval is not None:
        leases.start(expiry_interval)
    server = KVServer(
        prefill, leases, prefill.layout, "127.0.0.1", 0, MAX_CHUNK_BYTES, transport="nixl"
    )
    endpoint = await server.start()
    control = KVControl(MAX_CHUNK_BYTES, 10.0)
    grpc_client = GrpcKVClient(MAX_CHUNK_BYTES, 10.0, max_blocks=32, control=control)
    client = NixlKVClient(
        decode.kv_pool, 10.0, control=control, fallback=grpc_client, max_blocks=32, telemetry=True
    )
    p = NixlPair(prefill, decode, leases, server, client, endpoint)
    try:
        yield p
        assert await leases.drain(5.0), "a lease was never freed"
        assert await p.used_blocks() == (0, 0), "KV blocks leaked"
        assert server.senders["nixl"].holds == 0
    finally:
        await p.close()


def sender(p: NixlPair) -> NixlKVSender:
    return p.server.senders["nixl"]
