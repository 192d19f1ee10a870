"""KV between tensor-parallel groups of different sizes over gRPC, and the decode side's
client that moves it whatever the transport.

A decode rank needs exactly its own heads (`cluster.kv_transfer.head_plan`: runs, each held
whole by one prefill rank); over gRPC each run is one head-sliced `FetchKV` from that rank's
KV server (`GrpcKVClient.fetch_heads`), written into this rank's pool at the run's heads
(`GrpcHeads`). Nothing is gathered through one rank: every byte goes from the prefill rank that
holds it to the decode rank that needs it.

`ShardedKVClient` is the decode replica's client (every decode replica has one, so that a TP 1
decode pool reads a TP k prefill pool too): a handle whose layout is this pool's (the same TP
size and heads; at TP 1 on both sides always) goes to the configured transport unchanged; any
other goes through the head plan, rank 0's heads here (`heads`: over gRPC, or the nixl
transport's head-sliced READs) and every other rank's by an `ImportKV` call to that rank's KV
server (`rank_server`), all at once; it returns once every rank has written its heads (or
failed: then nothing writes the blocks any more either). A layout of another model, dtype or
block size, or heads that do not split, is FAILED_PRECONDITION before anything moves.
"""

from __future__ import annotations

import asyncio

import grpc
import torch

from cluster.engine.kv_cache import KVCache, KVExport, KVLayout
from cluster.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from cluster.kv_transfer.base import KVClient, settle
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.head_plan import HeadRun, head_plan, rank_heads, source_layout
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.kv_server_stubs import rpc_error
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

__all__ = ["GrpcHeads", "HeadRun", "ShardedKVClient", "fetch_heads", "head_plan", "rank_heads"]


async def fetch_heads(
    client: GrpcKVClient, handle: KVHandle, pool: KVCache, block_ids: list[int]
) -> int:
    """Fetch this rank's heads of `handle` (`head_plan`) into `block_ids` of `pool`; returns
    the bytes written. Every run's fetch is awaited to its end, even when one fails."""
    runs = head_plan(handle.layout, pool.layout)
    return sum(await _all(fetch_run(client, handle, pool, block_ids, run) for run in runs))


async def fetch_run(
    client: GrpcKVClient, handle: KVHandle, pool: KVCache, block_ids: list[int], run: HeadRun
) -> int:
    """One run of the head plan: a head-sliced `FetchKV` from its prefill rank, written into
    the run's heads of `block_ids`; the bytes written."""
    heads = source_layout(handle, run.rank).head_slice(run.start, run.count)
    kv = await client.fetch_heads(handle, run.rank, heads)
    await settle(asyncio.to_thread(_write_heads, pool, block_ids, run.offset, kv))
    return kv.k.nbytes + kv.v.nbytes


class GrpcHeads:
    """How a rank moves its own heads of a handle into its pool over gRPC (`fetch_heads`).
    Its `fetch_heads` returns (bytes written, bytes of them READ over NIXL: none)."""

    def __init__(self, client: GrpcKVClient) -> None:
        self.client = client

    async def fetch_heads(
        self, handle: KVHandle, pool: KVCache, block_ids: list[int]
    ) -> tuple[int, int]:
        return await fetch_heads(self.client, handle, pool, block_ids), 0

    async def fetch_run(
        self, handle: KVHandle, pool: KVCache, block_ids: list[int], run: HeadRun
    ) -> int:
        """One run only (`fetch_run`): a transport's fallback for a peer it cannot reach."""
        return await fetch_run(self.client, handle, pool, block_ids, run)

    async def close(self) -> None:
        pass  # the client is its owner's to close


def _write_heads(pool: KVCache, block_ids: list[int], offset: int, kv: KVExport) -> None:
    idx = torch.tensor(block_ids, dtype=torch.long, device=pool.k.device)
    n = kv.layout.num_kv_heads
    for dst, src in ((pool.k, kv.k), (pool.v, kv.v)):
        dst[:, idx, :, offset : offset + n] = src.to(dst.device)


async def _all(work) -> list:
    """Run every awaitable of `work` to its end; the first failure is raised after them all."""
    results = await settle(asyncio.gather(*work, return_exceptions=True))
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class ShardedKVClient(KVClient):
    """The decode replica's KV client (see the module docstring). `inner`: the configured
    transport's client; `slices`: the gRPC client of head-sliced fetches and `ImportKV` calls;
    `ranks`: the KV servers of this replica's ranks 1.. with the secret they take `ImportKV`
    with (none at TP 1); `heads`: how rank 0 moves its own heads (`GrpcHeads` over `slices`
    unless given: the nixl transport's head-sliced READs). `nixl_bytes`: per rank of this
    replica, the bytes of its heads READ over NIXL so far."""

    def __init__(
        self,
        inner: KVClient,
        slices: GrpcKVClient,
        ranks: tuple[str, ...] = (),
        replica_secret: bytes = b"",
        heads=None,
    ) -> None:
        self.inner = inner
        self.slices = slices
        self.ranks = ranks
        self.replica_secret = replica_secret
        self.heads = heads if heads is not None else GrpcHeads(slices)
        self.nixl_bytes = [0] * (len(ranks) + 1)

    async def fetch(self, handle: KVHandle, receiver_layout: KVLayout) -> KVExport:
        return await self.inner.fetch(handle, receiver_layout)

    async def fetch_into(self, handle: KVHandle, pool: KVCache, block_ids: list[int]) -> int:
        if handle.layout == pool.layout and not self.ranks:
            return await self.inner.fetch_into(handle, pool, block_ids)
        if pool.layout.tp_size != len(self.ranks) + 1:
            raise FailedPrecondition(
                f"a TP {pool.layout.tp_size} pool with {len(self.ranks) + 1} ranks' KV servers"
            )
        head_plan(handle.layout, pool.layout)  # refuses before anything moves
        work = [self.heads.fetch_heads(handle, pool, block_ids)]
        work += [self._import(endpoint, handle, block_ids) for endpoint in self.ranks]
        moved = await _all(work)
        for rank, (_, nixl) in enumerate(moved):
            self.nixl_bytes[rank] += nixl
        return sum(nbytes for nbytes, _ in moved)

    async def _import(
        self, endpoint: str, handle: KVHandle, block_ids: list[int]
    ) -> tuple[int, int]:
        request = pb.ImportKVRequest(
            handle=handle.to_proto(), block_ids=block_ids, replica_secret=self.replica_secret
        )
        # The rank's own fetches have the same deadline: it answers within it, or it is gone.
        timeout = 2 * self.slices.timeout_s
        try:
            stub = self.slices.stubs.stub(endpoint)
            response = await stub.ImportKV(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"ImportKV on rank {endpoint}: {details}") from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                # This replica's own rank is gone: the replica fails, the request goes elsewhere.
                raise Unavailable(f"ImportKV on rank {endpoint}: {code.name} {details}") from None
            raise rpc_error(exc, handle) from None
        return response.nbytes, response.nixl_bytes

    async def release(self, handle: KVHandle, reason: str) -> bool:
        return await self.inner.release(handle, reason)

    async def close(self) -> None:
        await self.inner.close()
        await self.heads.close()
        await self.slices.close()
