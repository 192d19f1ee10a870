"""`KVServerStubs`: the decode side's gRPC channels to the prefill replicas' `KVServer`s, and
`rpc_error`, what a failed call on them means as a pdserve error.

One channel per endpoint is kept, and closed once it has been unused for `idle_seconds` and for
the `timeout_s` deadline of any call (every call on it is made with `timeout_s`, so none is
still running on it): prefill replicas come and go with autoscaling, and their endpoints with
them. `KVControl` holds one, which every transport's client of a worker shares (`GrpcKVClient`
for FetchKV, the others for their control calls). Runs on one event loop.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from cluster.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PdServeError,
    Unauthenticated,
    Unavailable,
)
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.kv_wire import HEADER_SLACK, MAX_REQUEST_BYTES
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferStub

FetchKV = grpc.aio.UnaryStreamMultiCallable
FETCH_METHOD = "/pdserve.v1.KVTransfer/FetchKV"


class KVServerStubs:
    def __init__(self, max_chunk_bytes: int, timeout_s: float, idle_seconds: float) -> None:
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self.idle_seconds = idle_seconds
        self._stubs: dict[str, tuple[grpc.aio.Channel, KVTransferStub, FetchKV]] = {}
        self._last_used: dict[str, float] = {}
        self._closing: set[asyncio.Task] = set()

    def __len__(self) -> int:
        """Open channels."""
        return len(self._stubs)

    def stub(self, endpoint: str) -> KVTransferStub:
        """The stub on `endpoint`'s channel, opened if there is none."""
        return self._entry(endpoint)[1]

    def fetch_kv(self, endpoint: str) -> FetchKV:
        """FetchKV on `endpoint`'s channel, yielding each `KVChunk` as its serialized bytes
        (parsed by `kv_wire.decode_frame` without the two copies protobuf would make)."""
        return self._entry(endpoint)[2]

    async def close(self) -> None:
        stubs, self._stubs = self._stubs, {}
        self._last_used.clear()
        for channel, _, _ in stubs.values():
            await channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _entry(self, endpoint: str) -> tuple[grpc.aio.Channel, KVTransferStub, FetchKV]:
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
            fetch = channel.unary_stream(
                FETCH_METHOD,
                request_serializer=pb.FetchKVRequest.SerializeToString,
                response_deserializer=None,
                _registered_method=True,
            )
            self._stubs[endpoint] = (channel, KVTransferStub(channel), fetch)
        return self._stubs[endpoint]

    def _close_idle(self, now: float) -> None:
        """Close the channels unused for longer than both the idle time and a call's deadline."""
        horizon = now - max(self.idle_seconds, self.timeout_s)
        for endpoint in [e for e, t in self._last_used.items() if t < horizon]:
            del self._last_used[endpoint]
            channel = self._stubs.pop(endpoint)[0]
            task = asyncio.get_running_loop().create_task(channel.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def rpc_error(exc: grpc.aio.AioRpcError, handle: KVHandle) -> PdServeError:
    """The pdserve error for a failed KV server call about `handle` (see `base`)."""
    code, details = exc.code(), exc.details() or ""
    where = f"KV fetch of request {handle.request_id!r} from {handle.endpoint}"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return Unauthenticated(f"{where}: {details}")
    if code == grpc.StatusCode.NOT_FOUND:
        return Unavailable(f"{where}: the KV lease expired or was released ({details})")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(f"{where}: {details}")
    if code == grpc.StatusCode.UNIMPLEMENTED:  # the server does not serve this transport
        return FailedPrecondition(f"{where}: the KV server does not serve it ({details})")
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
