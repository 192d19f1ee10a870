"""KV between tensor-parallel groups of different sizes: which prefill rank sends which heads
to which decode rank, and the decode side's client that moves them.

A rank `r` of a TP `k` pool of a model with `T` KV heads holds heads `[r·T/k, r·T/k + T/k)`,
or, when `T < k`, the one head `⌊r·T/k⌋` (replicated, as `TPShard` splits the model). A decode
rank needs exactly its own heads: `head_plan` cuts them into runs, each held whole by one
prefill rank (of the ranks holding a replicated head, the one of the decode rank's index, so
the reads spread), and each run is one head-sliced `FetchKV` from that rank's KV server
(`GrpcKVClient.fetch_heads`), written into this rank's pool at the run's heads. Nothing is
gathered through one rank: every byte goes from the prefill rank that holds it to the decode
rank that needs it.

`ShardedKVClient` is the decode replica's client (every decode replica has one, so that a TP 1
decode pool reads a TP k prefill pool too): a handle whose layout is this pool's (the same TP
size and heads; at TP 1 on both sides always) goes to the configured transport unchanged; any
other goes through the head plan over gRPC, rank 0's heads here and every other rank's by an
`ImportKV` call to that rank's KV server (`rank_server`), all at once; it returns once every
rank has written its heads (or failed: then nothing writes the blocks any more either). A
layout of another model, dtype or block size, or heads that do not split, is
FAILED_PRECONDITION before anything moves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import grpc
import torch

from cluster.engine.kv_cache import KVCache, KVExport, KVLayout
from cluster.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from cluster.kv_transfer.base import KVClient, settle
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.kv_server_stubs import rpc_error
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads rank `rank` of a TP `tp_size` pool holds."""
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise FailedPrecondition(f"{total_kv_heads} KV heads do not split over TP {tp_size}")
    start = rank * total_kv_heads // tp_size
    return range(start, start + max(1, total_kv_heads // tp_size))


@dataclass(frozen=True)
class HeadRun:
    """Heads `[start, start + count)` of the model, read from prefill rank `rank` into this
    pool's heads from `offset`."""

    rank: int
    start: int
    count: int
    offset: int


def head_plan(source: KVLayout, dest: KVLayout) -> list[HeadRun]:
    """How the decode rank whose pool is `dest` gets its heads from the prefill pools of
    `source`'s replica (`source`: its rank 0's layout). FailedPrecondition if the two are not
    the same model's KV or the heads do not split."""
    if not source.same_model(dest):
        raise FailedPrecondition(
            f"KV layouts differ beyond their TP size and heads (prefill {source}, decode {dest})"
        )
    k, dest_rank = source.tp_size, dest.kv_head_start * dest.tp_size // dest.total_kv_heads
    owners = [rank_heads(source.total_kv_heads, k, r) for r in range(k)]
    runs: list[HeadRun] = []
    for h in range(dest.kv_head_start, dest.head_end):
        holders = [r for r in range(k) if h in owners[r]]
        rank = holders[dest_rank % len(holders)]
        last = runs[-1] if runs else None
        if last is not None and last.rank == rank and last.start + last.count == h:
            runs[-1] = HeadRun(rank, last.start, last.count + 1, last.offset)
        else:
            runs.append(HeadRun(rank, h, 1, h - dest.kv_head_start))
    return runs


def source_layout(handle: KVHandle, rank: int) -> KVLayout:
    """The layout of prefill rank `rank`'s pool, from its rank 0's (the handle's)."""
    heads = rank_heads(handle.layout.total_kv_heads, handle.layout.tp_size, rank)
    return replace(handle.layout, kv_head_start=heads.start, num_kv_heads=len(heads))


async def fetch_heads(
    client: GrpcKVClient, handle: KVHandle, pool: KVCache, block_ids: list[int]
) -> int:
    """Fetch this rank's heads of `handle` (`head_plan`) into `block_ids` of `pool`; returns
    the bytes written. Every run's fetch is awaited to its end, even when one fails."""
    runs = head_plan(handle.layout, pool.layout)

    async def one(run: HeadRun) -> int:
        heads = source_layout(handle, run.rank).head_slice(run.start, run.count)
        kv = await client.fetch_heads(handle, run.rank, heads)
        await settle(asyncio.to_thread(_write_heads, pool, block_ids, run.offset, kv))
        return kv.k.nbytes + kv.v.nbytes

    return sum(await _all(one(run) for run in runs))


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
    transport's client; `slices`: the gRPC client the head plan uses; `ranks`: the KV servers
    of this replica's ranks 1.. with the secret they take `ImportKV` with (none at TP 1)."""

    def __init__(
        self,
        inner: KVClient,
        slices: GrpcKVClient,
        ranks: tuple[str, ...] = (),
        replica_secret: bytes = b"",
    ) -> None:
        self.inner = inner
        self.slices = slices
        self.ranks = ranks
        self.replica_secret = replica_secret

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
        work = [fetch_heads(self.slices, handle, pool, block_ids)]
        work += [self._import(endpoint, handle, block_ids) for endpoint in self.ranks]
        return sum(await _all(work))

    async def _import(self, endpoint: str, handle: KVHandle, block_ids: list[int]) -> int:
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
        return response.nbytes

    async def release(self, handle: KVHandle, reason: str) -> bool:
        return await self.inner.release(handle, reason)

    async def close(self) -> None:
        await self.inner.close()
        await self.slices.close()
