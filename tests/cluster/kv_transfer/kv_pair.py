"""A prefill engine behind a real `KVServer` on loopback and a decode engine with a KV client:
the harness of the KV transport tests in this folder."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVExport
from cluster.kv_transfer.base import KVClient
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper
from tests.engine_kv import export_kv

BLOCK_SIZE = 16
# One block of one layer is 2 * 16 * 2 * 16 * 4 = 4 KiB: 8 KiB chunks split layers over blocks.
MAX_CHUNK_BYTES = 8192
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def make_engine(path: Path, **model) -> Engine:
    """A small engine for `path`; `model` overrides ModelConfig fields (device, dtype)."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=32)
    return Engine(EngineConfig(ModelConfig(str(path), **model), cache))


def prompt(length: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 512, (length,), generator=gen).tolist())


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


@dataclass
class Pair:
    """A prefill engine behind a KV server, and a decode engine with a KV client."""

    prefill: AsyncEngine
    decode: AsyncEngine
    leases: LeaseKeeper
    server: KVServer
    client: KVClient
    endpoint: str

    async def prefill_handle(self, rid: str, ids: tuple[int, ...]) -> KVHandle:
        request = Request(rid, ids, PARAMS, prefill_only=True)
        outs = [out async for out in await self.prefill.generate(request)]
        assert outs[-1].finish_reason == "prefilled"
        block_ids, num_tokens, expiry, token = await self.leases.grant(rid)
        return KVHandle(
            request_id=rid,
            num_tokens=num_tokens,
            endpoint=self.endpoint,
            transport="grpc",
            block_ids=tuple(block_ids),
            block_size=BLOCK_SIZE,
            layout=self.prefill.layout,
            lease_expiry_unix=expiry,
            capability_token=token,
            first_token_id=outs[-1].token_ids[0],
        )

    async def fetch_and_decode(self, handle: KVHandle, ids: tuple[int, ...]) -> list[int]:
        """Decode `handle`'s request as the decode worker does (`DecodeWorker._fetched`):
        reserve blocks, fetch the KV into them, release the lease, finish the import."""
        request = Request(handle.request_id, ids, PARAMS)
        rid, first = request.request_id, handle.first_token_id
        block_ids = await self.decode.call(lambda e: e.reserve_import(request))
        await self.client.fetch_into(handle, self.decode.kv_pool, block_ids)
        assert await self.client.release(handle, "fetched")
        tokens = [first]
        async for out in await self.decode._stream(rid, lambda e: e.finish_import(rid, first)):
            tokens.extend(out.token_ids)
        return tokens

    async def close(self) -> None:
        """Stop both ends: client, KV server, lease keeper, then the two engines."""
        await self.client.close()
        await self.server.stop(0)
        await self.leases.stop()
        await self.prefill.stop()
        await self.decode.stop()

    async def used_blocks(self) -> tuple[int, int]:
        stats = [
            await e.call(lambda e: e.stats().kv_blocks_used) for e in (self.prefill, self.decode)
        ]
        return stats[0], stats[1]


@asynccontextmanager
async def pair(
    path: Path,
    lease_seconds: float = 30.0,
    clock=time.time,
    expiry_interval: float | None = None,
    **model,
) -> AsyncIterator[Pair]:
    prefill = AsyncEngine(make_engine(path, **model))
    decode = AsyncEngine(make_engine(path, **model))
    prefill.start()
    decode.start()
    leases = LeaseKeeper(prefill, lease_seconds, Capability(b"test-secret"), clock=clock)
    if expiry_interval is not None:
        leases.start(expiry_interval)
    server = KVServer(
        prefill, leases, prefill.layout, "127.0.0.1", 0, max_chunk_bytes=MAX_CHUNK_BYTES
    )
    endpoint = await server.start()
    client = GrpcKVClient(MAX_CHUNK_BYTES, timeout_s=30.0, max_blocks=32)
    p = Pair(prefill, decode, leases, server, client, endpoint)
    try:
        yield p
        assert await leases.drain(5.0), "a lease was never freed"  # frees run in the background
        assert await p.used_blocks() == (0, 0), "KV blocks leaked"
    finally:
        await p.close()


async def fetch_exact_then_decode(
    p: Pair, prompts: dict[str, tuple[int, ...]], check: Callable[[KVExport, KVExport], None]
) -> dict[str, list[int]]:
    """Prefill every prompt; fetch the first one's KV once, `check(fetched, the prefill side's
    own export)` and require it bit-exact; then fetch and decode all of them concurrently."""
    handles = {rid: await p.prefill_handle(rid, ids) for rid, ids in prompts.items()}
    first = next(iter(prompts))
    want = await p.prefill.call(lambda e: export_kv(e, first))
    got = await p.client.fetch(handles[first], p.decode.layout)
    check(got, want)
    assert torch.equal(got.k.cpu(), want.k.cpu()) and torch.equal(got.v.cpu(), want.v.cpu())
    tokens = await asyncio.gather(
        *(p.fetch_and_decode(handles[rid], ids) for rid, ids in prompts.items())
    )
    return dict(zip(prompts, tokens, strict=True))


def colocated(path: Path, rid: str, ids: tuple[int, ...], **model) -> list[int]:
    engine = make_engine(path, **model)
    (out,) = engine.generate([Request(rid, ids, PARAMS)])
    assert engine.stats().kv_blocks_used == 0
    return out.token_ids
