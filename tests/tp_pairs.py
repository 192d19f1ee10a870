"""Prefill and decode replicas of several tensor-parallel sizes in one process, on the path the
workers take: per prefill TP size a replica (rank 0 here, ranks 1.. processes of their own with
their KV servers, `RankService`) behind a real `KVServer` and `LeaseKeeper`; per decode TP size a
replica with the `ShardedKVClient` a decode worker builds (`make_decode_client`), all for one
`transport` (grpc, or nixl: every rank also serves and READs with its own NIXL agent). The
harness of the TP KV tests and of `benchmarks.tp_bench`. On leaving, every lease must have ended
and every block be free."""

from __future__ import annotations

import time
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field

import torch

from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransferConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.tp_replica import TPReplica
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc.rank_server import RankService
from cluster.kv_transfer.grpc.tp_ranks import ShardedKVClient
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.transport_factory import make_decode_client
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

PAIRS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (prefill TP, decode TP)
SECRET = "ab" * 32
CHUNK = 1 << 20
BLOCK_SIZE = 16


@dataclass
class TPPairs:
    prefill: dict[int, AsyncEngine] = field(default_factory=dict)
    leases: dict[int, LeaseKeeper] = field(default_factory=dict)
    endpoints: dict[int, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    decode: dict[int, AsyncEngine] = field(default_factory=dict)
    client: dict[int, ShardedKVClient] = field(default_factory=dict)
    servers: dict[int, KVServer] = field(default_factory=dict)  # by prefill TP size
    transport: str = "grpc"  # what the prefill KV servers' handles name

    async def handle(self, k: int, rid: str, ids, max_tokens: int = 8) -> KVHandle:
        """Prefill `ids` on the TP `k` prefill replica; the lease's handle."""
        request = Request(rid, tuple(ids), _greedy(max_tokens), prefill_only=True)
        outs = [out async for out in await self.prefill[k].generate(request)]
        assert outs[-1].finish_reason == "prefilled"
        block_ids, num_tokens, expiry, token = await self.leases[k].grant(rid)
        endpoint, ranks = self.endpoints[k]
        return KVHandle(
            request_id=rid,
            num_tokens=num_tokens,
            endpoint=endpoint,
            transport=self.transport,
            block_ids=tuple(block_ids),
            block_size=BLOCK_SIZE,
            layout=self.prefill[k].layout,
            lease_expiry_unix=expiry,
            capability_token=token,
            first_token_id=outs[-1].token_ids[0],
            rank_endpoints=ranks,
        )

    async def move(self, pair: tuple[int, int], rid: str, ids) -> float:
        """Prefill on P, move the KV into D's reserved blocks, free both: seconds of the move."""
        k, m = pair
        handle = await self.handle(k, rid, ids)
        request = Request(rid, tuple(ids), _greedy(8))
        block_ids = await self.decode[m].call(lambda e: e.reserve_import(request))
        try:
            t0 = time.perf_counter()
            await self.client[m].fetch_into(handle, self.decode[m].kv_pool, block_ids)
            return time.perf_counter() - t0
        finally:
            await self.decode[m].call(lambda e: e.cancel_import(rid))
            await self.client[m].release(handle, "fetched")

    async def decode_one(self, pair: tuple[int, int], rid: str, ids, max_tokens: int) -> list:
        """Prefill on P, decode on D as the decode worker does: every token, the first too."""
        k, m = pair
        handle = await self.handle(k, rid, ids, max_tokens)
        request, first = Request(rid, tuple(ids), _greedy(max_tokens)), handle.first_token_id
        decode = self.decode[m]
        block_ids = await decode.call(lambda e: e.reserve_import(request))
        try:
            await self.client[m].fetch_into(handle, decode.kv_pool, block_ids)
        except BaseException:
            await decode.call(lambda e: e.cancel_import(rid))
            await self.client[m].release(handle, "aborted")
            raise
        assert await self.client[m].release(handle, "fetched")
        tokens = [first]
        async for out in await decode._stream(rid, lambda e: e.finish_import(rid, first)):
            tokens.extend(out.token_ids)
        return tokens


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _engine(config: EngineConfig, tp: int, secret: bytes, stack: ExitStack, transport: str):
    if tp == 1:
        return Engine(config), None
    service = RankService("127.0.0.1", SECRET, secret, CHUNK, 30.0, transport)
    replica = stack.enter_context(TPReplica(config, tp, rank_service=service))
    return replica.engine, replica


@asynccontextmanager
async def tp_pairs(
    path, stack: ExitStack, num_blocks: int = 128, pairs=PAIRS, transport="grpc", max_pins=None
):
    """`TPPairs` for `pairs` on the checkpoint at `path`, every KV server and rank serving
    `transport` (and gRPC) and every decode replica's client built for it as the decode worker
    builds it; `max_pins` bounds the prefill KV servers' `PinKV` holds (their default if None);
    `stack` closes the TP replicas."""
    transfer = TransferConfig(
        transport=transport, max_chunk_bytes=CHUNK, fetch_timeout_seconds=30.0, secret=SECRET
    )
    config = EngineConfig(
        ModelConfig(str(path)),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        SchedulerConfig(max_num_batched_tokens=4096),
    )
    p = TPPairs(transport=transport)
    servers = []
    try:
        for k in sorted({k for k, _ in pairs}):
            engine, replica = _engine(config, k, b"p", stack, transport)
            p.prefill[k] = AsyncEngine(engine)
            p.prefill[k].start()
            p.leases[k] = LeaseKeeper(p.prefill[k], 30.0, Capability(bytes.fromhex(SECRET)))
            limits = {"max_pins": max_pins} if max_pins else {}
            server = KVServer(
                p.prefill[k],
                p.leases[k],
                engine.layout,
                "127.0.0.1",
                0,
                CHUNK,
                transport=transport,
                **limits,
            )
            p.servers[k] = server
            assert server.transport == transport, f"this KV server cannot serve {transport}"
            servers.append(server)
            endpoint = await server.start()
            if replica is not None:
                replica.publish_leader(endpoint)
            p.endpoints[k] = (endpoint, replica.rank_endpoints if replica else ())
        for m in sorted({m for _, m in pairs}):
            engine, replica = _engine(config, m, b"d", stack, transport)
            engine.imports_every_rank = True
            p.decode[m] = AsyncEngine(engine)
            p.decode[m].start()
            ranks = replica.rank_endpoints if replica else ()
            pool = p.decode[m].kv_pool
            client = make_decode_client(transfer, torch.device("cpu"), pool, ranks, b"d")
            assert isinstance(client, ShardedKVClient)
            p.client[m] = client
        yield p
        for k, leases in p.leases.items():
            assert await leases.drain(5.0), f"a lease of the TP {k} prefill was never freed"
        for e in (*p.prefill.values(), *p.decode.values()):
            assert await e.call(lambda e: e.stats().kv_blocks_used) == 0, "KV blocks leaked"
    finally:
        for client in p.client.values():
            await client.close()
        for server in servers:
            await server.stop(0)
        for leases in p.leases.values():
            await leases.stop()
        for e in (*p.prefill.values(), *p.decode.values()):
            await e.stop()
