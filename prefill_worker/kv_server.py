"""`KVServer`: the prefill worker's end of every KV transport (`pdserve.v1.KVTransfer`).

`FetchKV` (transport "grpc") streams the KV of one lease in chunks (`GrpcKVSender`); `PushKV`
(transports "gloo" and "nccl") sends it over a direct channel the decode worker opened with
`OpenChannel` (`CollectiveKVSender`); `HoldKV` (transport "nixl") pins a lease while the decode
worker READs it from the pool `ConnectNixl` described (`NixlKVSender`). All check, before
anything is read: the handle is well
formed, its capability token is genuine (UNAUTHENTICATED), the receiver's layout and the
handle's equal ours (FAILED_PRECONDITION), and the lease is live (NOT_FOUND: released, expired
or unknown). The lease is pinned for the whole transfer (`LeaseKeeper.begin_fetch` /
`end_fetch`), so its blocks can be read on a worker thread while the engine thread runs its
steps. Fetching does not end the lease; the client calls `ReleaseKV`. `CancelPrefill` (a
router's, with a cancel token) ends a request by id wherever it is on this worker
(`LeaseKeeper.cancel`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.kv_cache import KVLayout
from cluster.errors import (
    FailedPrecondition,
    InvalidArgument,
    PdServeError,
    Unauthenticated,
    Unavailable,
)
from cluster.kv_transfer.kv_handle import KVHandle, layout_from_proto
from cluster.kv_transfer.kv_wire import HEADER_SLACK, MAX_REQUEST_BYTES
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import (
    KVTransferServicer,
    add_KVTransferServicer_to_server,
)
from prefill_worker.collective_kv_sender import CollectiveKVSender
from prefill_worker.grpc_kv_sender import GrpcKVSender
from prefill_worker.lease_keeper import LeaseKeeper
from prefill_worker.nixl_kv_sender import NixlKVSender

SERVICE = "pdserve.v1.KVTransfer"
log = logging.getLogger("ray.serve." + __name__)


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
        transport: str = "grpc",
        channel_timeout_s: float = 30.0,
        channel_idle_s: float = 60.0,
        max_channels: int = 256,
    ) -> None:
        """`read_batch_bytes` bounds the KV copied out of the pool per read of `FetchKV`. With
        `transport` "gloo" or "nccl" the server also serves direct channels (InvalidArgument
        here if this process cannot run it): each joins and sends within `channel_timeout_s`,
        is closed after `channel_idle_s` unused, and at most `max_channels` are open at once.
        With "nixl" it registers the engine's pool with a NIXL agent (where NIXL is not usable,
        it serves grpc, and `transport` says so); a hold lasts at most `channel_timeout_s`."""
        self.grpc = GrpcKVSender(async_engine, layout, read_batch_bytes)
        if max_chunk_bytes < self.grpc.unit_bytes:
            raise InvalidArgument(
                f"max_chunk_bytes={max_chunk_bytes} is below one block of one layer "
                f"({self.grpc.unit_bytes} bytes)"
            )
        if channel_timeout_s <= 0 or max_channels <= 0:
            raise InvalidArgument("channel_timeout_s and max_channels must be positive")
        self.collective = CollectiveKVSender(
            async_engine,
            lease_keeper,
            layout,
            host,
            transport,
            timeout_s=channel_timeout_s,
            idle_s=channel_idle_s,
            max_channels=max_channels,
        )
        self.transport = transport  # what this server's handles say: `transport`, or grpc
        self.nixl: NixlKVSender | None = None
        if transport == "nixl":
            try:
                self.nixl = NixlKVSender(async_engine.kv_pool, layout, channel_timeout_s)
            except Unavailable as exc:  # FetchKV serves the same leases
                log.warning("KV server falls back to grpc: %s", exc.message)
                self.transport = "grpc"
        self.leases = lease_keeper
        self.layout = layout
        self.host = host
        self.port = port
        self.max_chunk_bytes = max_chunk_bytes
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
        _add_servicer(self, server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = server.add_insecure_port(f"{host}:{self.port}")
        await server.start()
        self._server = server
        self.endpoint = f"{host}:{port}"
        self.collective.start()
        return self.endpoint

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight RPCs get `grace` seconds to finish."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        await self.collective.stop()
        if self.nixl is not None:
            await self.nixl.stop()

    # -- RPCs ------------------------------------------------------------------------------

    async def FetchKV(
        self, request: pb.FetchKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Yields `KVChunk` messages already in wire form (`kv_frame.encode_frame`); the method is
        registered without a response serializer (`_add_servicer`)."""
        try:
            rid, block_ids = await self._pin(request)
        except PdServeError as exc:
            await _abort(context, exc)
        try:
            limit = request.max_chunk_bytes or self.max_chunk_bytes
            limit = max(min(limit, self.max_chunk_bytes), self.grpc.unit_bytes)
            async for frame in self.grpc.frames(rid, block_ids, limit, request.checksum):
                yield frame
        except PdServeError as exc:
            await _abort(context, exc)
        finally:
            self.leases.end_fetch(rid)

    async def OpenChannel(
        self, request: pb.OpenChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenChannelResponse:
        try:
            self._authenticate(request.handle)
            channel_id, store_port = self.collective.open(request.transport)
        except PdServeError as exc:
            await _abort(context, exc)
        return pb.OpenChannelResponse(channel_id=channel_id, store_port=store_port)

    async def PushKV(
        self, request: pb.PushKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.PushKVResponse:
        try:
            rid, block_ids = await self._pin(request)
        except PdServeError as exc:
            await _abort(context, exc)
        try:
            return await self.collective.push(request.channel_id, rid, block_ids)
        except PdServeError as exc:
            await _abort(context, exc)

    async def CloseChannel(
        self, request: pb.CloseChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseChannelResponse:
        return pb.CloseChannelResponse(closed=self.collective.close(request.channel_id))

    async def ConnectNixl(
        self, request: pb.ConnectNixlRequest, context: grpc.aio.ServicerContext
    ) -> pb.NixlPool:
        try:
            self._authenticate(request.handle)
            if not request.HasField("receiver_layout"):
                raise InvalidArgument("ConnectNixl needs receiver_layout")
            self.layout.check_matches(layout_from_proto(request.receiver_layout))
            if self.nixl is None:
                raise FailedPrecondition("this KV server does not serve transport 'nixl'")
            return self.nixl.describe()
        except PdServeError as exc:
            await _abort(context, exc)

    async def HoldKV(
        self, request: pb.HoldKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVHeld]:
        try:
            if self.nixl is None:
                raise FailedPrecondition("this KV server does not serve transport 'nixl'")
            rid, _ = await self._pin(request)
        except PdServeError as exc:
            await _abort(context, exc)
        try:
            async for held in self.nixl.hold():
                yield held
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

    async def CancelPrefill(
        self, request: pb.CancelPrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelPrefillResponse:
        try:
            if not request.request_id:
                raise InvalidArgument("CancelPrefill needs a request_id", param="request_id")
            if not self.leases.capability.verify_cancel(request.request_id, request.cancel_token):
                raise Unauthenticated("bad cancel token")
            released = await self.leases.cancel(request.request_id)
        except PdServeError as exc:
            await _abort(context, exc)
        return pb.CancelPrefillResponse(released=released)

    # -- checks shared by every transport ----------------------------------------------------

    def _authenticate(self, handle_msg: pb.KVHandle) -> KVHandle:
        handle = KVHandle.from_proto(handle_msg)
        cap = self.leases.capability
        if not cap.verify(handle.request_id, handle.block_ids, handle.capability_token):
            raise Unauthenticated("bad capability token")
        return handle

    async def _pin(
        self, request: pb.FetchKVRequest | pb.PushKVRequest | pb.HoldKVRequest
    ) -> tuple[str, list[int]]:
        """Check a presented handle against the token, the layouts and its lease, then pin the
        lease: (request id, block ids). The caller owes `leases.end_fetch(request id)`."""
        handle = self._authenticate(request.handle)
        if not request.HasField("receiver_layout"):
            raise InvalidArgument("a KV transfer needs receiver_layout")
        self.layout.check_matches(layout_from_proto(request.receiver_layout))
        self.layout.check_matches(handle.layout)
        rid = handle.request_id
        block_ids, num_tokens = await self.leases.begin_fetch(rid, handle.capability_token)
        if block_ids != list(handle.block_ids) or num_tokens != handle.num_tokens:
            self.leases.end_fetch(rid)
            raise InvalidArgument("handle does not match its lease")
        return rid, block_ids


def _add_servicer(servicer: KVServer, server: grpc.aio.Server) -> None:
    """`add_KVTransferServicer_to_server`, except that FetchKV sends the bytes its handler
    yields as they are: they are `KVChunk` messages framed by `cluster.kv_transfer.kv_frame`, which
    protobuf would copy twice more on the way out."""
    generated = _Handlers()
    add_KVTransferServicer_to_server(servicer, generated)
    handlers = dict(generated.handlers)
    handlers["FetchKV"] = grpc.unary_stream_rpc_method_handler(
        servicer.FetchKV, request_deserializer=pb.FetchKVRequest.FromString
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class _Handlers:
    """Stands in for a server to collect the generated method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, generic_handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        assert service == SERVICE, service
        self.handlers = handlers


async def _abort(context: grpc.aio.ServicerContext, exc: PdServeError) -> None:
    await context.abort(getattr(grpc.StatusCode, exc.grpc_code), exc.message)
