"""The `grpc` KV transport, the baseline every KV server serves: the decode side streams a
lease's KV in checked chunks (`GrpcKVClient`) from the prefill side's FetchKV
(`GrpcKVSender`). No native dependency; any network, CPU or GPU."""

from __future__ import annotations

from cluster.kv_transfer.base import ClientParts, KVClient, KVSender
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.grpc.grpc_kv_sender import GrpcKVSender
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
