"""`GrpcKVClient`: the decode worker's end of the `grpc` KV transport.

`fetch` pulls the KV named by a `KVHandle` from the prefill worker's `KVServer` and checks it
chunk by chunk against the receiver's own layout (`kv_wire.ChunkAssembler`); it does not end the
lease: once the data is in the decode pool, call `release(handle, "fetched")` (or
"aborted" if the request is given up), so the prefill worker frees the blocks before the lease
would expire. One channel per endpoint is kept, and closed once it has been unused for
`idle_seconds` and for the `timeout_s` deadline of any call (so no call is still on it):
prefill replicas come and go with autoscaling, and their endpoints with them.

Errors, as pdserve errors: a layout mismatch is FailedPrecondition (raised before any network
call when the handle already shows it); a bad token is Unauthenticated; an expired, released or
unknown lease, an unreachable server or a malformed stream is Unavailable (the router may retry
the request from prefill); a fetch over `timeout_s` is DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from cluster.engine.kv_cache import KVExport, KVLayout
from cluster.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PdServeError,
    Unauthenticated,
    Unavailable,
)
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto
from cluster.kv_transfer.kv_wire import ChunkAssembler, decode_frame, unit_bytes
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferStub

log = logging.getLogger(__name__)

FetchKV = grpc.aio.UnaryStreamMultiCallable

HEADER_SLACK = 4096  # room for the chunk header and protobuf framing above max_chunk_bytes
MAX_REQUEST_BYTES = 4 << 20  # a FetchKVRequest carries a handle: ~5 bytes per block id
FETCH_METHOD = "/pdserve.v1.KVTransfer/FetchKV"


class GrpcKVClient:
    def __init__(
        self,
        max_chunk_bytes: int,
        timeout_s: float,
        *,
        max_blocks: int = 1 << 16,
        idle_seconds: float = 60.0,
    ):
        """`max_blocks` caps the KV one fetch may allocate (the decode pool's size is apt)."""
        if min(max_chunk_bytes, timeout_s, max_blocks, idle_seconds) <= 0:
            raise InvalidArgument(
                "max_chunk_bytes, timeout_s, max_blocks and idle_seconds must be positive"
            )
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self.max_blocks = max_blocks
        self.idle_seconds = idle_seconds
        self._stubs: dict[str, tuple[grpc.aio.Channel, KVTransferStub, FetchKV]] = {}
        self._last_used: dict[str, float] = {}
        self._closing: set[asyncio.Task] = set()

    async def fetch(self, handle: KVHandle, receiver_layout: KVLayout) -> KVExport:
        """The KV of `handle`, checked against `receiver_layout`. The lease stays held."""
        receiver_layout.check_matches(handle.layout)
        if unit_bytes(receiver_layout) > self.max_chunk_bytes:
            raise FailedPrecondition(
                f"max_chunk_bytes={self.max_chunk_bytes} is below one block of one layer"
            )
        assembler = ChunkAssembler(
            receiver_layout, len(handle.block_ids), handle.num_tokens, self.max_blocks
        )
        request = pb.FetchKVRequest(
            handle=handle.to_proto(),
            receiver_layout=layout_to_proto(receiver_layout),
            max_chunk_bytes=self.max_chunk_bytes,
        )
        call = self._fetch_kv(handle.endpoint)(request, timeout=self.timeout_s)
        adding: asyncio.Future | None = None
        try:
            # Each chunk is checked and copied on a worker thread while the next one arrives.
            async for frame in call:
                if adding is not None:
                    await adding
                adding = asyncio.ensure_future(
                    asyncio.to_thread(assembler.add, *decode_frame(frame))
                )
            if adding is not None:
                await adding
            return assembler.finish()
        except grpc.aio.AioRpcError as exc:
            raise _error(exc, handle) from None
        except InvalidArgument as exc:
            raise Unavailable(
                f"malformed KV stream from {handle.endpoint} for request "
                f"{handle.request_id!r}: {exc.message}"
            ) from None
        finally:
            if not call.done():
                call.cancel()
            if adding is not None:
                await asyncio.gather(adding, return_exceptions=True)

    async def release(self, handle: KVHandle, reason: str) -> bool:
        """Ask the prefill worker to free the lease ("fetched" or "aborted"). Best effort:
        False if nothing was freed or the call failed (the lease then expires on its own)."""
        request = pb.ReleaseKVRequest(
            request_id=handle.request_id, capability_token=handle.capability_token, reason=reason
        )
        try:
            response = await self._stub(handle.endpoint).ReleaseKV(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "ReleaseKV %s on %s failed: %s %s",
                handle.request_id,
                handle.endpoint,
                exc.code().name,
                exc.details(),
            )
            return False
        return response.released

    async def close(self) -> None:
        stubs, self._stubs = self._stubs, {}
        self._last_used.clear()
        for channel, _, _ in stubs.values():
            await channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def __len__(self) -> int:
        """Open channels."""
        return len(self._stubs)

    def _fetch_kv(self, endpoint: str) -> FetchKV:
        self._stub(endpoint)
        return self._stubs[endpoint][2]

    def _stub(self, endpoint: str) -> KVTransferStub:
        now = time.monotonic()
        self._last_used[endpoint] = now
        self._close_idle(now)
        if endpoint not in self._stubs:
            channel = grpc.aio.insecure_channel(
                endpoint,
                options=[
                    ("grpc.max_receive_message_length", self.max_chunk_bytes + HEADER_SLACK),
                    ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
                ],
            )
            # FetchKV's chunks arrive as bytes, parsed by `kv_wire.decode_frame` without the
            # two copies protobuf would make of each.
            fetch = channel.unary_stream(
                FETCH_METHOD,
                request_serializer=pb.FetchKVRequest.SerializeToString,
                response_deserializer=None,
                _registered_method=True,
            )
            self._stubs[endpoint] = (channel, KVTransferStub(channel), fetch)
        return self._stubs[endpoint][1]

    def _close_idle(self, now: float) -> None:
        """Close the channels unused for longer than both the idle time and a call's deadline
        (every call on a channel is made with `timeout_s`, so none is still running on it)."""
        horizon = now - max(self.idle_seconds, self.timeout_s)
        for endpoint in [e for e, t in self._last_used.items() if t < horizon]:
            del self._last_used[endpoint]
            channel = self._stubs.pop(endpoint)[0]
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def _error(exc: grpc.aio.AioRpcError, handle: KVHandle) -> PdServeError:
    code, details = exc.code(), exc.details() or ""
    where = f"KV fetch of request {handle.request_id!r} from {handle.endpoint}"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Unauthenticated(f"{where}: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return Unavailable(f"{where}: the KV lease expired or was released ({details})")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(f"{where}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"{where}: timed out ({details})")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(f"{where}: {details}")
    if code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
    ):
        return Unavailable(f"{where}: {code.name} {details}")
    return PdServeError(f"{where}: {code.name} {details}")
