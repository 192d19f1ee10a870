"""What a transport's sender gets from the prefill worker's KV server: `LeasePins`, the small
lease protocol it pins leases through (the prefill worker's `LeaseKeeper` implements it), and
`SenderParts`; with the checks every sender makes before reading a lease (`pin`) or handing
out a way to read the pool (`check_live`), the status a refusal becomes (`abort`), and the
generated handlers of `pdserve.v1.KVTransfer` methods (`generated_handlers`).

A pin (`begin_fetch`) keeps a lease's blocks from being freed, reused or written until its
`end_fetch`: expiry skips a pinned lease and a release waits for the pin to end. So a sender
may read the blocks on any thread while it holds the pin.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import grpc

from cluster.engine.kv_cache import KVLayout
from cluster.errors import InvalidArgument, PdServeError, Unauthenticated
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_handle import KVHandle, layout_from_proto
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import add_KVTransferServicer_to_server

if TYPE_CHECKING:
    from cluster.engine.async_engine import AsyncEngine

SERVICE = "pdserve.v1.KVTransfer"


class LeasePins(Protocol):
    capability: Capability  # verifies the handles' tokens

    async def begin_fetch(self, request_id: str, token: bytes) -> tuple[list[int], int]:
        """Pin the live lease of `request_id`: its (block ids, token count). NotFound if it
        was released, expired or never granted; Unauthenticated for a token not its own."""
        ...

    def end_fetch(self, request_id: str) -> None:
        """End one pin of `begin_fetch`."""
        ...

    def on_end(self, listener: Callable[[str], None]) -> None:
        """Call `listener(request_id)` once for every lease, as it ends (released for any
        reason, or expired): no pin of it begins after that."""
        ...


@dataclass(frozen=True)
class SenderParts:
    """What a sender is built from: the prefill engine and its KV `layout`, the server's
    `leases`, the `host` it binds, the `transport` name it serves, the chunk limit, how much
    KV one read may copy (`read_batch_bytes`), and the limits of direct channels and holds."""

    async_engine: AsyncEngine
    leases: LeasePins
    layout: KVLayout
    host: str
    transport: str
    max_chunk_bytes: int
    read_batch_bytes: int = 64 << 20
    channel_timeout_s: float = 30.0
    channel_idle_s: float = 60.0
    max_channels: int = 256


def authenticate(leases: LeasePins, handle_msg: pb.KVHandle) -> KVHandle:
    """The handle, well formed and carrying a genuine token (Unauthenticated otherwise)."""
    handle = KVHandle.from_proto(handle_msg)
    if not leases.capability.verify(handle.request_id, handle.block_ids, handle.capability_token):
        raise Unauthenticated("bad capability token")
    return handle


async def check_live(parts: SenderParts, handle_msg: pb.KVHandle) -> KVHandle:
    """The handle, if its token is genuine (Unauthenticated) and its lease still granted
    (NotFound once it ended or expired): the access that hands out a way to read the pool
    (NIXL metadata, a direct channel) is bounded by a live lease. Checks; does not pin."""
    handle = authenticate(parts.leases, handle_msg)
    rid = handle.request_id
    block_ids, num_tokens = await parts.leases.begin_fetch(rid, handle.capability_token)
    parts.leases.end_fetch(rid)
    if block_ids != list(handle.block_ids) or num_tokens != handle.num_tokens:
        raise InvalidArgument("handle does not match its lease")
    return handle


async def pin(parts: SenderParts, request) -> tuple[str, list[int]]:
    """Check a transfer request's `handle` and `receiver_layout` (token, both layouts equal
    ours, FailedPrecondition otherwise) and pin its lease: (request id, block ids). The caller
    owes `parts.leases.end_fetch(request id)`."""
    rid, block_ids, _ = await pin_slice(parts, request, whole=True)
    return rid, block_ids


async def pin_slice(
    parts: SenderParts, request, whole: bool = False
) -> tuple[str, list[int], KVLayout]:
    """`pin` for a `receiver_layout` that may name a head slice of our pool (a rank of another
    TP size, `KVLayout.check_serves`): (request id, block ids, the slice's layout). The
    handle's layout is our replica's rank 0's: the same model at the same TP size."""
    handle = authenticate(parts.leases, request.handle)
    if not request.HasField("receiver_layout"):
        raise InvalidArgument("a KV transfer needs receiver_layout")
    receiver = layout_from_proto(request.receiver_layout)
    if whole:
        parts.layout.check_matches(receiver)
        parts.layout.check_matches(handle.layout)
    else:
        parts.layout.check_serves(receiver)
        ours = replace(parts.layout, kv_head_start=0, num_kv_heads=parts.layout.total_kv_heads)
        ours.check_matches(
            replace(handle.layout, kv_head_start=0, num_kv_heads=handle.layout.total_kv_heads)
        )
    rid = handle.request_id
    block_ids, num_tokens = await parts.leases.begin_fetch(rid, handle.capability_token)
    if block_ids != list(handle.block_ids) or num_tokens != handle.num_tokens:
        parts.leases.end_fetch(rid)
        raise InvalidArgument("handle does not match its lease")
    return rid, block_ids, receiver


async def abort(context: grpc.aio.ServicerContext, exc: PdServeError) -> None:
    """End the call with the status of `exc`."""
    await context.abort(getattr(grpc.StatusCode, exc.grpc_code), exc.message)


def generated_handlers(servicer, methods: tuple[str, ...]) -> dict[str, grpc.RpcMethodHandler]:
    """The generated handlers of `methods` of `pdserve.v1.KVTransfer`, bound to `servicer`."""
    collector = _Collector()
    add_KVTransferServicer_to_server(servicer, collector)
    return {m: h for m, h in collector.handlers.items() if m in methods}


class _Collector:
    """Stands in for a server to collect the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        assert service == SERVICE, service
        self.handlers = dict(handlers)
