"""`CollectiveKVClient`: the decode worker's end of the `gloo` and `nccl` KV transports
(contract: `KVClient`).

The KV moves over a `KVChannel`: a two-rank process group with the prefill worker named in the
handle (this side rank 1), opened on first use with `OpenChannel`, cached per endpoint and
closed after `idle_seconds` unused (the prefill side is told with `CloseChannel`). Per transfer:
`PushKV` announces the transfer; the announced dtype and shape are checked against our own
layout and the handle before anything is allocated; then the keys and values are received, as
one message, straight into a new tensor on `device` (the decode GPU under nccl: no host copy).
One transfer per pair at a time. A channel the server no longer holds is reopened once; a broken
one (peer gone, timeout, a cancelled transfer) is dropped and the fetch fails with Unavailable.

The control calls (OpenChannel, PushKV, CloseChannel, ReleaseKV) go over gRPC, through the
worker's `KVControl` (its channels, `KVServerStubs`: one gRPC channel per prefill endpoint
carries everything); the handles whose transport is the baseline are fetched by the `fallback`
client.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections import defaultdict

import grpc
import torch
import torch.distributed as dist

from cluster.engine.kv_cache import KVExport, KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument, Unavailable
from cluster.kv_transfer import registry
from cluster.kv_transfer.base import KVClient
from cluster.kv_transfer.collective.kv_channel import (
    DECODE_RANK,
    KVChannel,
    local_address_for,
    transport_device,
)
from cluster.kv_transfer.collective.kv_channel_cache import KVChannelCache
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto, split_endpoint
from cluster.kv_transfer.kv_server_stubs import rpc_error
from cluster.kv_transfer.kv_wire import DTYPES
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

log = logging.getLogger("ray.serve." + __name__)

# PushKV failures raised before the server queued a send: the channel is still in step.
_REFUSALS = (
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
)


class CollectiveKVClient(KVClient):
    def __init__(
        self,
        transport: str,
        device: torch.device,
        timeout_s: float,
        *,
        control: KVControl,
        fallback: KVClient,
        max_blocks: int = 1 << 16,
        idle_seconds: float = 60.0,
    ) -> None:
        """`control` carries the control calls, `fallback` fetches the handles of the baseline
        transport. InvalidArgument if this process cannot run `transport` (nccl without CUDA)."""
        self.control = control
        self.fallback = fallback
        self.stubs = control.stubs
        self.timeout_s = timeout_s
        self.max_blocks = max_blocks
        self.transport = transport
        self.device = transport_device(transport, device)
        self.channels: KVChannelCache[str] = KVChannelCache(idle_seconds, self._close_remote)
        self._opening: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def fetch(self, handle: KVHandle, receiver_layout: KVLayout) -> KVExport:
        """The KV of `handle`, checked against `receiver_layout`. The lease stays held."""
        if handle.transport == registry.BASELINE:
            return await self.fallback.fetch(handle, receiver_layout)
        if handle.transport != self.transport:
            raise FailedPrecondition(
                f"KV handle of request {handle.request_id!r} uses transport "
                f"{handle.transport!r}; this decode worker speaks {self.transport!r}"
            )
        receiver_layout.check_matches(handle.layout)
        shape = (receiver_layout.num_layers, len(handle.block_ids), *receiver_layout.block_shape)
        if receiver_layout.dtype not in DTYPES:
            raise FailedPrecondition(f"KV dtype {receiver_layout.dtype!r} is not supported")
        if len(handle.block_ids) > self.max_blocks:
            raise InvalidArgument(
                f"KV of {len(handle.block_ids)} blocks is over the cap of {self.max_blocks}"
            )
        self.channels.start()
        request = pb.PushKVRequest(
            handle=handle.to_proto(), receiver_layout=layout_to_proto(receiver_layout)
        )
        for attempt in range(2):
            channel = await self._channel(handle)
            channel.busy += 1
            try:
                async with channel.lock:
                    request.channel_id = channel.id
                    k, v = await self._transfer(channel, request, handle, receiver_layout, shape)
                return KVExport(receiver_layout, handle.num_tokens, k, v)
            except _Reopen:
                if attempt:
                    raise Unavailable(
                        f"KV channel to {handle.endpoint} was closed twice in a row"
                    ) from None
            finally:
                channel.busy -= 1
        raise AssertionError("unreachable")

    async def release(self, handle: KVHandle, reason: str) -> bool:
        """ReleaseKV, as for every transport (`KVControl.release`)."""
        return await self.control.release(handle, reason)

    async def close(self) -> None:
        await self.channels.stop()
        await self.fallback.close()
        await self.control.close()

    # -- one transfer ------------------------------------------------------------------------

    async def _transfer(
        self,
        channel: KVChannel,
        request: pb.PushKVRequest,
        handle: KVHandle,
        layout: KVLayout,
        shape: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """PushKV, check the announcement, receive. Drops the channel on anything that may
        leave the pair out of step (a queued send nobody receives, a cut-off receive)."""
        if channel.closed:
            raise _Reopen
        try:
            stub = self.stubs.stub(handle.endpoint)
            response = await stub.PushKV(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in _REFUSALS:
                self.channels.drop(handle.endpoint, channel)
            if exc.code() == grpc.StatusCode.ABORTED:
                raise _Reopen from None
            raise rpc_error(exc, handle) from None
        except BaseException:
            self.channels.drop(handle.endpoint, channel)
            raise
        try:
            _check_announcement(response, layout, shape, handle)
            kv = torch.empty((2, *shape), dtype=DTYPES[layout.dtype], device=self.device)
            await channel.recv(kv, response.tag)
        except BaseException:
            self.channels.drop(handle.endpoint, channel)
            raise
        return kv[0], kv[1]

    # -- channels ----------------------------------------------------------------------------

    async def _channel(self, handle: KVHandle) -> KVChannel:
        """The open channel to `handle.endpoint`, opened (once, however many ask) if none."""
        endpoint = handle.endpoint
        async with self._opening[endpoint]:
            channel = self.channels.get(endpoint)
            if channel is not None:
                return channel
            request = pb.OpenChannelRequest(transport=self.transport, handle=handle.to_proto())
            try:
                stub = self.stubs.stub(endpoint)
                opened = await stub.OpenChannel(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise rpc_error(exc, handle) from None
            host, _ = split_endpoint(endpoint)
            if not 0 < opened.store_port < 65536 or not opened.channel_id:
                raise Unavailable(f"KV server {endpoint} opened a malformed channel")
            channel = KVChannel(
                opened.channel_id, self.transport, DECODE_RANK, self.device, self.timeout_s
            )
            timeout = datetime.timedelta(seconds=self.timeout_s)

            def store() -> dist.Store:
                tcp = dist.TCPStore(
                    host, opened.store_port, None, False, timeout, wait_for_workers=False
                )
                return dist.PrefixStore(channel.id, tcp)

            try:
                await channel.join(store, local_address_for(host))
            except Unavailable as exc:
                raise Unavailable(f"KV channel to {endpoint} not joined: {exc.message}") from None
            self.channels.add(endpoint, channel)
            return channel

    async def _close_remote(self, endpoint: str, channel: KVChannel) -> None:
        """After an idle eviction: best effort, the server's own idle timer is the backstop."""
        request = pb.CloseChannelRequest(channel_id=channel.id)
        try:
            await self.stubs.stub(endpoint).CloseChannel(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.info("CloseChannel %s on %s: %s", channel.id, endpoint, exc.code().name)


class _Reopen(Exception):
    """The server no longer holds the channel: open a new one and try again."""


def _check_announcement(
    response: pb.PushKVResponse, layout: KVLayout, shape: tuple[int, ...], handle: KVHandle
) -> None:
    where = f"KV push of request {handle.request_id!r} from {handle.endpoint}"
    if response.dtype != layout.dtype:
        raise FailedPrecondition(f"{where}: dtype {response.dtype!r} != {layout.dtype!r}")
    if tuple(response.shape) != shape:
        raise FailedPrecondition(f"{where}: shape {list(response.shape)} != {list(shape)}")
    nbytes = DTYPES[layout.dtype].itemsize
    for d in shape:
        nbytes *= d
    if response.nbytes != nbytes or response.tag % 2 or response.tag >= 1 << 31:
        raise Unavailable(f"{where}: malformed announcement (nbytes, tag)")
