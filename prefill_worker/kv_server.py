"""`KVServer`: the prefill worker's end of the `grpc` KV transport (`pdserve.v1.KVTransfer`).

`FetchKV` streams the KV of one lease in chunks (`cluster.kv_wire`) after checking, before
anything is read: the handle is well formed, its capability token is genuine
(UNAUTHENTICATED), the receiver's layout and the handle's equal ours (FAILED_PRECONDITION), and
the lease is live (NOT_FOUND: released, expired or unknown). The lease is pinned for the whole
stream (`LeaseKeeper.begin_fetch` / `end_fetch`) and blocks are read on the engine thread, a
batch of layers at a time. Fetching does not end the lease; the client calls `ReleaseKV`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from functools import partial

import grpc

from cluster.async_engine import AsyncEngine
from cluster.engine import Engine
from cluster.errors import InvalidArgument, NotFound, PdServeError, Unauthenticated
from cluster.kv_cache import KVLayout
from cluster.kv_handle import KVHandle, layout_from_proto
from cluster.kv_wire import encode_chunks, unit_bytes
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import (
    KVTransferServicer,
    add_KVTransferServicer_to_server,
)
from prefill_worker.lease_keeper import LeaseKeeper

HEADER_SLACK = 4096  # room for the chunk header and protobuf framing above max_chunk_bytes
MAX_REQUEST_BYTES = 4 << 20  # a FetchKVRequest carries a handle: ~5 bytes per block id


class KVServer(KVTransferServicer):
    def __init__(
        self,
        async_engine: AsyncEngine,
        lease_keeper: LeaseKeeper,
        layout: KVLayout,
        host: str,
        port: int,
        max_chunk_bytes: int,
        *,
        read_batch_bytes: int = 64 << 20,
    ) -> None:
        """`read_batch_bytes` bounds the KV copied out of the pool per engine-thread call."""
        self.unit_bytes = unit_bytes(layout)
        if max_chunk_bytes < self.unit_bytes:
            raise InvalidArgument(
                f"max_chunk_bytes={max_chunk_bytes} is below one block of one layer "
                f"({self.unit_bytes} bytes)"
            )
        self.engine = async_engine
        self.leases = lease_keeper
        self.layout = layout
        self.host = host
        self.port = port
        self.max_chunk_bytes = max_chunk_bytes
        self.read_batch_bytes = read_batch_bytes
        self.endpoint: str | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Bind and serve; returns the bound "host:port" (port 0 picks a free one)."""
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", self.max_chunk_bytes + HEADER_SLACK),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ]
        )
        add_KVTransferServicer_to_server(self, server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = server.add_insecure_port(f"{host}:{self.port}")
        await server.start()
        self._server = server
        self.endpoint = f"{host}:{port}"
        return self.endpoint

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight RPCs get `grace` seconds to finish."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    # -- RPCs ------------------------------------------------------------------------------

    async def FetchKV(
        self, request: pb.FetchKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVChunk]:
        try:
            handle = KVHandle.from_proto(request.handle)
            cap = self.leases.capability
            if not cap.verify(handle.request_id, handle.block_ids, handle.capability_token):
                raise Unauthenticated("bad capability token")
            if not request.HasField("receiver_layout"):
                raise InvalidArgument("FetchKV needs receiver_layout")
            self.layout.check_matches(layout_from_proto(request.receiver_layout))
            self.layout.check_matches(handle.layout)
            rid = handle.request_id
            block_ids, num_tokens = await self.leases.begin_fetch(rid, handle.capability_token)
        except PdServeError as exc:
            await _abort(context, exc)
        try:
            if block_ids != list(handle.block_ids) or num_tokens != handle.num_tokens:
                await _abort(context, InvalidArgument("handle does not match its lease"))
            limit = request.max_chunk_bytes or self.max_chunk_bytes
            limit = max(min(limit, self.max_chunk_bytes), self.unit_bytes)
            async for header, data in self._chunks(rid, block_ids, limit):
                yield pb.KVChunk(header=header, data=data)
        except PdServeError as exc:
            await _abort(context, exc)
        finally:
            self.leases.end_fetch(rid)

    async def ReleaseKV(
        self, request: pb.ReleaseKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseKVResponse:
        try:
            if not request.request_id:
                raise InvalidArgument("ReleaseKV needs a request_id", param="request_id")
            released = await self.leases.release(
                request.request_id, request.reason, token=request.capability_token
            )
        except PdServeError as exc:
            await _abort(context, exc)
        return pb.ReleaseKVResponse(released=released)

    # -- reading ---------------------------------------------------------------------------

    async def _chunks(
        self, request_id: str, block_ids: list[int], max_chunk_bytes: int
    ) -> AsyncIterator[tuple[bytes, bytes]]:
        num_layers = self.layout.num_layers
        per_read = max(1, self.read_batch_bytes // (len(block_ids) * self.unit_bytes))
        for l0 in range(0, num_layers, per_read):
            layers = slice(l0, min(l0 + per_read, num_layers))
            k, v = await self.engine.call(partial(_read, request_id, block_ids, layers))
            for chunk in await asyncio.to_thread(_encode, k, v, max_chunk_bytes, l0):
                yield chunk


def _read(request_id: str, block_ids: list[int], layers: slice, engine: Engine):
    """On the engine thread: copy the lease's blocks, after checking they are still its own."""
    held, _ = engine.held_blocks(request_id)
    if held != block_ids:
        raise NotFound(f"the KV blocks of request {request_id!r} are no longer held")
    return engine.kv_cache.read(block_ids, layers=layers)


def _encode(k, v, max_chunk_bytes: int, layer_offset: int) -> list[tuple[bytes, bytes]]:
    return list(encode_chunks(k, v, max_chunk_bytes, layer_offset=layer_offset))


async def _abort(context: grpc.aio.ServicerContext, exc: PdServeError) -> None:
    await context.abort(getattr(grpc.StatusCode, exc.grpc_code), exc.message)
