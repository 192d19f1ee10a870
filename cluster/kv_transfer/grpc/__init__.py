"""The `grpc` KV transport, the baseline every KV server serves: the decode side streams a
lease's KV in checked chunks (`GrpcKVClient`) from the prefill side's FetchKV
(`GrpcKVSender`). No native dependency; any network, CPU or GPU.

It also moves KV between tensor-parallel groups of different sizes, whatever the configured
transport (`tp_ranks`: head-sliced fetches, rank to rank; `rank_server`: the KV server of a
replica's rank 1..)."""

from __future__ import annotations

from collections.abc import Callable

from cluster.kv_transfer.base import ClientParts, KVClient, KVSender
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.grpc.grpc_kv_sender import GrpcKVSender
from cluster.kv_transfer.grpc.rank_server import RankService
from cluster.kv_transfer.grpc.tp_ranks import GrpcHeads, ShardedKVClient
from cluster.kv_transfer.lease_pins import SenderParts


def make_client(parts: ClientParts) -> KVClient:
    t = parts.transfer
    return GrpcKVClient(
        t.max_chunk_bytes,
        t.fetch_timeout_seconds,
        max_blocks=parts.max_blocks,
        idle_seconds=t.channel_idle_seconds,
        checksum=t.checksum,
        control=parts.control,
    )


def make_sender(parts: SenderParts) -> KVSender:
    return GrpcKVSender(parts)


def make_sharded_client(
    inner: KVClient,
    parts: ClientParts,
    ranks: tuple[str, ...],
    replica_secret: bytes,
    own_heads: Callable[[GrpcHeads], object] | None = None,
) -> KVClient:
    """The decode replica's client: `inner` for KV of its own layout, head-sliced fetches for
    KV of another TP size (over gRPC, or what `own_heads(grpc_heads)` makes: a transport's own
    head-sliced reads, with gRPC as their fallback), `ImportKV` to its ranks 1.. (`ranks`)."""
    slices = make_client(parts)
    assert isinstance(slices, GrpcKVClient)
    grpc_heads = GrpcHeads(slices)
    heads = own_heads(grpc_heads) if own_heads is not None else grpc_heads
    return ShardedKVClient(inner, slices, ranks, replica_secret, heads)


def make_rank_service(transfer, host: str, replica_secret: bytes) -> RankService:
    """What a tensor-parallel replica's ranks 1.. serve their KV with (see `rank_server`):
    gRPC always, and `transfer.transport`'s own where it has rank parts (nixl)."""
    return RankService(
        host,
        transfer.secret,
        replica_secret,
        transfer.max_chunk_bytes,
        transfer.fetch_timeout_seconds,
        transfer.transport,
        transfer.channel_idle_seconds,
    )
