"""`CollectiveKVSender`: the prefill side of the `gloo` and `nccl` KV transports (contract:
`KVSender`): the OpenChannel, PushKV and CloseChannel RPCs. OpenChannel checks the handle's
token and that its lease is live (`check_live`); PushKV checks the handle and pins its lease
(`lease_pins.pin`) until the send ends.

`open` makes a `KVChannel` for a decode worker (this side is rank 0) and joins it in the
background through the one rendezvous TCPStore this sender hosts; `push` queues the send of a
pinned lease's blocks on the channel, which gathers them (beside the engine thread,
`AsyncEngine.read_held_kv`) on its own stream once the prefill step that wrote them is done.
Channels are cached by id and closed after `idle_s` without a transfer, or as soon as one breaks
(the transfer's receiver then fails with UNAVAILABLE and opens a new channel)."""

from __future__ import annotations

import asyncio
import datetime
import functools
import logging
import math
import secrets
import socket

import grpc
import torch
import torch.distributed as dist

from cluster.errors import (
    FailedPrecondition,
    InvalidArgument,
    PdServeError,
    ResourceExhausted,
    Unavailable,
)
from cluster.kv_transfer.base import KVSender
from cluster.kv_transfer.collective.kv_channel import PREFILL_RANK, KVChannel, transport_device
from cluster.kv_transfer.collective.kv_channel_cache import KVChannelCache
from cluster.kv_transfer.kv_wire import DTYPES
from cluster.kv_transfer.lease_pins import (
    SenderParts,
    abort,
    check_live,
    generated_handlers,
    pin,
)
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferServicer

log = logging.getLogger("ray.serve." + __name__)


class ChannelGone(PdServeError):
    """PushKV on a channel this server does not hold (closed, evicted or broken). Only on the
    wire: the client opens a new channel and retries."""

    grpc_code = "ABORTED"


class CollectiveKVSender(KVSender, KVTransferServicer):
    def __init__(self, parts: SenderParts) -> None:
        """Each channel joins and sends within `parts.channel_timeout_s`, is closed after
        `parts.channel_idle_s` unused; at most `parts.max_channels` are open at once.
        InvalidArgument if this process cannot run `parts.transport`."""
        if parts.channel_timeout_s <= 0 or parts.max_channels <= 0:
            raise InvalidArgument("channel_timeout_s and max_channels must be positive")
        self.parts = parts
        self.engine = parts.async_engine
        self.leases = parts.leases
        self.layout = parts.layout
        self.host = parts.host
        self.transport = parts.transport
        self.device = transport_device(parts.transport, parts.async_engine.device)
        self.timeout_s = parts.channel_timeout_s
        self.max_channels = parts.max_channels
        self.channels: KVChannelCache[str] = KVChannelCache(parts.channel_idle_s)
        self._store: dist.TCPStore | None = None
        self._tasks: set[asyncio.Task] = set()

    def handlers(self) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
        methods = ("OpenChannel", "PushKV", "CloseChannel")
        return {self.SERVICE: generated_handlers(self, methods)}

    async def OpenChannel(
        self, request: pb.OpenChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.OpenChannelResponse:
        try:
            await check_live(self.parts, request.handle)
            channel_id, store_port = self.open(request.transport)
        except PdServeError as exc:
            await abort(context, exc)
        return pb.OpenChannelResponse(channel_id=channel_id, store_port=store_port)

    async def PushKV(
        self, request: pb.PushKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.PushKVResponse:
        try:
            rid, block_ids = await pin(self.parts, request)
        except PdServeError as exc:
            await abort(context, exc)
        try:
            return await self.push(request.channel_id, rid, block_ids)
        except PdServeError as exc:
            await abort(context, exc)

    async def CloseChannel(
        self, request: pb.CloseChannelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseChannelResponse:
        return pb.CloseChannelResponse(closed=self.close(request.channel_id))

    async def start(self) -> None:
        self.channels.start()

    async def stop(self) -> None:
        await self.channels.stop()
        for task in list(self._tasks):  # sends stuck on a closed channel: unpin their leases
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._store = None

    def open(self, transport: str) -> tuple[str, int]:
        """A new channel for `transport`, joined in the background: (its id, the rendezvous
        store's port)."""
        if transport != self.transport:
            raise FailedPrecondition(f"this KV server serves {self.transport!r}, not {transport!r}")
        if len(self.channels) >= self.max_channels:
            raise ResourceExhausted(f"this KV server holds {self.max_channels} channels")
        channel = KVChannel(
            secrets.token_hex(16), self.transport, PREFILL_RANK, self.device, self.timeout_s
        )
        store = self._rendezvous_store()
        channel.busy += 1  # until joined: never evicted half-made
        channel.joined = self._spawn(self._join(channel, store))
        self.channels.add(channel.id, channel)
        return channel.id, store.port

    async def push(
        self, channel_id: str, request_id: str, block_ids: list[int]
    ) -> pb.PushKVResponse:
        """Queue the send of the lease's blocks on channel `channel_id`: one message of keys
        and values, gathered from the pool on the channel's stream after the prefill work that
        wrote them (an event recorded now, on the engine's stream). The response announces
        it. The caller's pin of the lease (`leases.begin_fetch`) passes to this: it ends when
        the send does, or at once if this raises (ChannelGone if the channel is not open)."""
        channel = self.channels.get(channel_id)
        if channel is not None:
            channel.busy += 1  # not evicted until the send ends
        try:
            if channel is None or not await channel.joined or channel.closed:
                raise ChannelGone(f"no open KV channel {channel_id!r}; open a new one")
            self.engine.read_held_kv(request_id, block_ids, lambda pool: None)  # still held
        except BaseException:
            if channel is not None:
                channel.busy -= 1
            self.leases.end_fetch(request_id)
            raise
        ready = _step_done(self.engine.device)
        tag = channel.next_tag()
        self._spawn(self._send(channel, request_id, block_ids, ready, tag))  # ends the fetch
        shape = (self.layout.num_layers, len(block_ids), *self.layout.block_shape)
        nbytes = DTYPES[self.layout.dtype].itemsize * math.prod(shape)
        return pb.PushKVResponse(dtype=self.layout.dtype, shape=shape, nbytes=nbytes, tag=tag)

    def close(self, channel_id: str) -> bool:
        """Close a channel the decode side is done with; False if there was none."""
        return self.channels.drop(channel_id)

    def _rendezvous_store(self) -> dist.TCPStore:
        """The TCPStore every channel of this sender rendezvouses in (one port, created on the
        first open). It listens on `host` only: left to itself a TCPStore listens on every
        interface, so it is handed a socket bound here (the store owns and closes it)."""
        if self._store is None:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.bind((self.host, 0))
                listener.listen()
                port = listener.getsockname()[1]
            except OSError:
                listener.close()
                raise
            self._store = dist.TCPStore(
                self.host,
                port,
                None,
                True,
                timeout,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
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

    def _gather(self, request_id: str, block_ids: list[int], device: torch.device):
        """The channel's worker thread, on its stream: the lease's keys and values in one
        tensor on `device` (the pool's own under nccl: no host copy)."""
        kv = self.engine.read_held_kv(request_id, block_ids, lambda pool: pool.gather(block_ids))
        return kv.to(device)

    async def _send(
        self,
        channel: KVChannel,
        request_id: str,
        block_ids: list[int],
        ready: torch.cuda.Event | None,
        tag: int,
    ) -> None:
        try:
            gather = functools.partial(self._gather, request_id, block_ids, channel.device)
            await channel.send(gather, tag, ready)
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


def _step_done(device: torch.device) -> torch.cuda.Event | None:
    """An event after every prefill step queued so far on `device` (the engine runs on the
    default stream); None for a host pool."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.default_stream(device))
    return event
