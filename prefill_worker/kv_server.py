"""`KVServer`: the prefill worker's end of every KV transport (`pdserve.v1.KVTransfer`).

`FetchKV` (transport "grpc") streams the KV of one lease in chunks (`cluster.kv_transfer.kv_wire`);
`PushKV` (transports "gloo" and "nccl") sends it over a direct channel the decode worker opened
with `OpenChannel` (`cluster.kv_transfer.kv_channel`; this side is rank 0 and hosts the rendezvous
TCPStore).
Both check, before anything is read: the handle is well formed, its capability token is genuine
(UNAUTHENTICATED), the receiver's layout and the handle's equal ours (FAILED_PRECONDITION), and
the lease is live (NOT_FOUND: released, expired or unknown). The lease is pinned for the whole
transfer (`LeaseKeeper.begin_fetch` / `end_fetch`), so its blocks can be read on a worker
thread while the engine thread runs its steps: a fetch never waits for a prefill step to end.
Fetching does not end the lease; the client calls `ReleaseKV`.

Channels are cached by id and closed after `channel_idle_s` without a transfer, or as soon as
one breaks (the transfer's receiver then fails with UNAVAILABLE and opens a new channel).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from collections.abc import AsyncIterator

import grpc
import torch
import torch.distributed as dist

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVLayout
from cluster.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PdServeError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from cluster.kv_transfer.kv_channel import PREFILL_RANK, KVChannel, transport_device
from cluster.kv_transfer.kv_channel_cache import KVChannelCache
from cluster.kv_transfer.kv_handle import KVHandle, layout_from_proto
from cluster.kv_transfer.kv_wire import (
    ChunkRange,
    chunk_header,
    chunk_ranges,
    encode_frame,
    gather_chunks,
    unit_bytes,
)
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import (
    KVTransferServicer,
    add_KVTransferServicer_to_server,
)
from prefill_worker.lease_keeper import LeaseKeeper

HEADER_SLACK = 4096  # room for the chunk header and protobuf framing above max_chunk_bytes
SERVICE = "pdserve.v1.KVTransfer"
MAX_REQUEST_BYTES = 4 << 20  # a FetchKVRequest carries a handle: ~5 bytes per block id

log = logging.getLogger(__name__)


class ChannelGone(PdServeError):
    """PushKV on a channel this server does not hold (closed, evicted or broken). Only on the
    wire: the client opens a new channel and retries."""

    grpc_code = "ABORTED"


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
        """`read_batch_bytes` bounds the KV copied out of the pool per engine-thread call of
        `FetchKV`. With `transport` "gloo" or "nccl" the server also serves direct channels
        (InvalidArgument here if this process cannot run it): each joins and sends within
        `channel_timeout_s`, is closed after `channel_idle_s` unused, and at most
        `max_channels` are open at once."""
        self.unit_bytes = unit_bytes(layout)
        if max_chunk_bytes < self.unit_bytes:
            raise InvalidArgument(
                f"max_chunk_bytes={max_chunk_bytes} is below one block of one layer "
                f"({self.unit_bytes} bytes)"
            )
        if channel_timeout_s <= 0 or max_channels <= 0:
            raise InvalidArgument("channel_timeout_s and max_channels must be positive")
        self.engine = async_engine
        self.leases = lease_keeper
        self.layout = layout
        self.host = host
        self.port = port
        self.max_chunk_bytes = max_chunk_bytes
        self.read_batch_bytes = read_batch_bytes
        self.transport = transport
        self.device = (
            None if transport == "grpc" else transport_device(transport, async_engine.engine.device)
        )
        self.channel_timeout_s = channel_timeout_s
        self.max_channels = max_channels
        self.channels: KVChannelCache[str] = KVChannelCache(channel_idle_s)
        self.endpoint: str | None = None
        self._server: grpc.aio.Server | None = None
        self._store: dist.TCPStore | None = None
        self._tasks: set[asyncio.Task] = set()

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
        if self.device is not None:
            self.channels.start()
        return self.endpoint

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight RPCs get `grace` seconds to finish."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        await self.channels.stop()
        for task in list(self._tasks):  # sends stuck on a closed channel: unpin their leases
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._store = None

    # -- RPCs ------------------------------------------------------------------------------

    async def FetchKV(
        self, request: pb.FetchKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Yields `KVChunk` messages already in wire form (`kv_wire.encode_frame`); the method is
        registered without a response serializer (`_add_servicer`)."""
        try:
            rid, block_ids = await self._pin(request)
        except PdServeError as exc:
            await _abort(context, exc)
        try:
            limit = request.max_chunk_bytes or self.max_chunk_bytes
            limit = max(min(limit, self.max_chunk_bytes), self.unit_bytes)
            async for frame in self._frames(rid, block_ids, limit):
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
            if self.device is None or request.transport != self.transport:
                raise FailedPrecondition(
                    f"this KV server serves {self.transport!r}, not {request.transport!r}"
                )
            if len(self.channels) >= self.max_channels:
                raise ResourceExhausted(f"this KV server holds {self.max_channels} channels")
            channel = KVChannel(
                secrets.token_hex(16),
                self.transport,
                PREFILL_RANK,
                self.device,
                self.channel_timeout_s,
            )
            store = self._rendezvous_store()
        except PdServeError as exc:
            await _abort(context, exc)
        channel.busy += 1  # until joined: never evicted half-made
        channel.joined = self._spawn(self._join(channel, store))
        self.channels.add(channel.id, channel)
        return pb.OpenChannelResponse(channel_id=channel.id, store_port=store.port)

    async def PushKV(
        self, request: pb.PushKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.PushKVResponse:
        try:
            rid, block_ids = await self._pin(request)
        except PdServeError as exc:
            await _abort(context, exc)
        channel = self.channels.get(request.channel_id)
        if channel is not None:
            channel.busy += 1  # not evicted until the send ends
        try:
            if channel is None or not await channel.joined or channel.closed:
                raise ChannelGone(f"no open KV channel {request.channel_id!r}; open a new one")
            k, v = await asyncio.to_thread(
                _read_for_send, rid, block_ids, channel.device, self.engine.engine
            )
        except BaseException as exc:
            if channel is not None:
                channel.busy -= 1
            self.leases.end_fetch(rid)
            if isinstance(exc, PdServeError):
                await _abort(context, exc)
            raise
        tag = channel.next_tag()
        self._spawn(self._send(channel, rid, k, v, tag))  # ends the fetch, unpins the channel
        return pb.PushKVResponse(dtype=self.layout.dtype, shape=k.shape, nbytes=k.nbytes, tag=tag)

    async def CloseChannel(
        self, request: pb.CloseChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseChannelResponse:
        return pb.CloseChannelResponse(closed=self.channels.drop(request.channel_id))

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

    # -- checks shared by every transport ----------------------------------------------------

    def _authenticate(self, handle_msg: pb.KVHandle) -> KVHandle:
        handle = KVHandle.from_proto(handle_msg)
        cap = self.leases.capability
        if not cap.verify(handle.request_id, handle.block_ids, handle.capability_token):
            raise Unauthenticated("bad capability token")
        return handle

    async def _pin(self, request: pb.FetchKVRequest | pb.PushKVRequest) -> tuple[str, list[int]]:
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

    # -- direct channels ---------------------------------------------------------------------

    def _rendezvous_store(self) -> dist.TCPStore:
        """The TCPStore every channel of this server rendezvouses in (one port, created on the
        first OpenChannel; it listens on all interfaces)."""
        if self._store is None:
            timeout = datetime.timedelta(seconds=self.channel_timeout_s)
            self._store = dist.TCPStore(self.host, 0, None, True, timeout, wait_for_workers=False)
        return self._store

    async def _join(self, channel: KVChannel, store: dist.TCPStore) -> bool:
        try:
            await channel.join(lambda: dist.PrefixStore(channel.id, store), self.host)
            return True
        except Unavailable as exc:
            log.warning("KV channel %s was not joined: %s", channel.id, exc.message)
            self.channels.drop(channel.id, channel)
            return False
        finally:
            channel.busy -= 1

    async def _send(
        self, channel: KVChannel, request_id: str, k: torch.Tensor, v: torch.Tensor, tag: int
    ) -> None:
        try:
            await channel.send(k, v, tag)
        except Unavailable as exc:
            log.warning("KV send of %s failed: %s", request_id, exc.message)
            self.channels.drop(channel.id, channel)
        finally:
            channel.busy -= 1
            self.leases.end_fetch(request_id)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- reading ---------------------------------------------------------------------------

    async def _frames(
        self, request_id: str, block_ids: list[int], max_chunk_bytes: int
    ) -> AsyncIterator[bytes]:
        """The lease's chunks in wire form. A producer task reads them out of the pool (up to
        `read_batch_bytes` per call) and frames them, on worker threads, while earlier chunks
        are sent; at most two framed chunks wait for the socket."""
        frames: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(maxsize=2)
        producer = asyncio.create_task(
            self._produce(request_id, block_ids, max_chunk_bytes, frames)
        )
        try:
            while (frame := await frames.get()) is not None:
                if isinstance(frame, Exception):
                    raise frame
                yield frame
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    async def _produce(
        self,
        request_id: str,
        block_ids: list[int],
        max_chunk_bytes: int,
        frames: asyncio.Queue[bytes | Exception | None],
    ) -> None:
        try:
            ranges = chunk_ranges(
                self.layout.num_layers, len(block_ids), self.unit_bytes, max_chunk_bytes
            )
            per_read = max(1, self.read_batch_bytes // max_chunk_bytes)
            for i in range(0, len(ranges), per_read):
                batch = ranges[i : i + per_read]
                pieces = await asyncio.to_thread(
                    _read, request_id, block_ids, batch, self.engine.engine
                )
                for r, data in zip(batch, pieces, strict=True):
                    await frames.put(await asyncio.to_thread(_frame, r, data, self.layout.dtype))
            await frames.put(None)
        except Exception as exc:  # handed to the stream, which fails the RPC with it
            await frames.put(exc)


# The readers below run on worker threads, beside the engine thread, and only between a
# lease's `begin_fetch` and `end_fetch`: while it is pinned the engine neither frees nor reuses
# its blocks, and nothing writes them (a held sequence's prompt is complete; its full blocks
# are shared read-only through the prefix cache), so the copies see settled data while the
# engine writes other blocks of the same pool.


def _read(request_id: str, block_ids: list[int], ranges: list[ChunkRange], engine: Engine):
    """Copies of the chunks `ranges` of the lease's blocks, out of the pool."""
    _check_held(request_id, block_ids, engine)
    return gather_chunks(engine.kv_cache.k, engine.kv_cache.v, block_ids, ranges)


def _check_held(request_id: str, block_ids: list[int], engine: Engine) -> None:
    """Before a read: the engine still holds the lease's sequence on these very blocks (one
    lookup, made under the GIL; the pin keeps the answer true for the rest of the read)."""
    held, _ = engine.held_blocks(request_id)
    if held != block_ids:
        raise NotFound(f"the KV blocks of request {request_id!r} are no longer held")


def _frame(r: ChunkRange, data, dtype: str) -> bytes:
    return encode_frame(chunk_header(r, data, dtype), data)


def _read_for_send(request_id: str, block_ids: list[int], device: torch.device, engine: Engine):
    """The lease's blocks as two contiguous tensors on `device` (the pool's own device under
    nccl: no host copy), complete before any other stream reads them."""
    _check_held(request_id, block_ids, engine)
    k, v = engine.kv_cache.read(block_ids)
    k, v = k.to(device), v.to(device)
    if k.is_cuda:
        torch.cuda.current_stream(k.device).synchronize()
    return k, v


def _add_servicer(servicer: KVServer, server: grpc.aio.Server) -> None:
    """`add_KVTransferServicer_to_server`, except that FetchKV sends the bytes its handler
    yields as they are: they are `KVChunk` messages framed by `cluster.kv_transfer.kv_wire`, which
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
