"""`KVServer`: the prefill worker's KV server (`pdserve.v1.KVTransfer` and whatever services
its transports add), a thin host for the transports' senders.

It mounts the RPC handlers of the senders `make_senders` builds for its `transport` (the
baseline's, which every KV server serves, and the transport's own; `cluster.kv_transfer`'s
registry names them), and serves the RPCs every transport shares: `ReleaseKV` (the decode worker
ends a lease), `CancelPrefill` (a router's, with a cancel token, ends a request by id wherever
it is on this worker, `LeaseKeeper.cancel`) and `PinKV` (the KV server of one of this replica's
tensor-parallel ranks pins a lease while it reads its own heads of it; at most `max_pins` at
once, RESOURCE_EXHAUSTED beyond: each is an open stream and a timer). Each sender checks a
presented handle before anything is read (its token is genuine, UNAUTHENTICATED; the receiver's
layout and the handle's equal ours, FAILED_PRECONDITION; the lease is live, NOT_FOUND) and pins
the lease for the whole transfer through the `LeaseKeeper` (`LeasePins`), so its blocks can be
read on a worker thread while the engine thread runs its steps. An RPC of a transport this
server does not serve is UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.kv_cache import KVLayout
from cluster.errors import InvalidArgument, PdServeError, ResourceExhausted, Unauthenticated
from cluster.kv_transfer.kv_wire import HEADER_SLACK, MAX_REQUEST_BYTES
from cluster.kv_transfer.lease_pins import SERVICE, SenderParts, abort, generated_handlers
from cluster.kv_transfer.transport_factory import make_senders
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferServicer
from prefill_worker.lease_keeper import LeaseKeeper

# PinKV holds served at once. A TP k replica's ranks 1.. hold one per read in flight (a TP 4
# prefill replica read by 64 decode ranks at once: 192), so this is far above any real load
# and still bounds what a misbehaving caller can keep open.
MAX_PINS = 1024


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
        max_pins: int = MAX_PINS,
    ) -> None:
        """`read_batch_bytes` bounds the KV copied out of the pool per read of a chunked
        transfer; `channel_timeout_s`, `channel_idle_s` and `max_channels` bound a transport's
        direct channels and holds (`SenderParts`); `max_pins` the `PinKV` holds served at once.
        InvalidArgument if this process cannot
        serve `transport`; where it is registered but not usable here, the server serves the
        baseline, and `transport` says so."""
        if channel_timeout_s <= 0 or max_channels <= 0 or max_pins <= 0:
            raise InvalidArgument("channel_timeout_s, max_channels and max_pins must be positive")
        parts = SenderParts(
            async_engine,
            lease_keeper,
            layout,
            host,
            transport,
            max_chunk_bytes,
            read_batch_bytes,
            channel_timeout_s,
            channel_idle_s,
            max_channels,
        )
        # What this server's handles say: `transport`, or the baseline it fell back to.
        self.transport, self.senders = make_senders(parts)
        self.leases = lease_keeper
        self.layout = layout
        self.host = host
        self.port = port
        self.max_chunk_bytes = max_chunk_bytes
        self.pin_timeout_s = channel_timeout_s
        self.max_pins = max_pins
        self.pins = 0  # PinKV holds open now
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
        own = ("ReleaseKV", "CancelPrefill", "PinKV")
        services = {SERVICE: generated_handlers(self, own)}
        for sender in self.senders.values():
            for service, handlers in sender.handlers().items():
                services.setdefault(service, {}).update(handlers)
        for service, handlers in services.items():
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service, handlers),)
            )
            server.add_registered_method_handlers(service, handlers)
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = server.add_insecure_port(f"{host}:{self.port}")
        await server.start()
        self._server = server
        self.endpoint = f"{host}:{port}"
        for sender in self.senders.values():
            await sender.start()
        return self.endpoint

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight RPCs get `grace` seconds to finish."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        for sender in self.senders.values():
            await sender.stop()

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
            await abort(context, exc)
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
            await abort(context, exc)
        return pb.CancelPrefillResponse(released=released)

    async def PinKV(
        self, request: pb.PinKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVPinned]:
        rid = request.request_id
        try:
            if not rid:
                raise InvalidArgument("PinKV needs a request_id", param="request_id")
            if self.pins >= self.max_pins:
                raise ResourceExhausted(
                    f"this KV server holds {self.pins} PinKV pins, its limit (max_pins); "
                    "retry once some end"
                )
            block_ids, num_tokens = await self.leases.begin_fetch(rid, request.capability_token)
        except PdServeError as exc:
            await abort(context, exc)
        self.pins += 1
        try:
            yield pb.KVPinned(block_ids=block_ids, num_tokens=num_tokens)
            await asyncio.sleep(self.pin_timeout_s)  # until the caller ends the call, or this
        finally:
            self.pins -= 1
            self.leases.end_fetch(rid)
