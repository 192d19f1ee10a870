"""`KVControl`: the calls to a prefill replica's KV server that every transport shares —
`release` (ReleaseKV, the decode side's end of a lease) and `cancel_prefill` (CancelPrefill,
the router's) — over one `KVServerStubs` (a gRPC channel per endpoint), which the transports'
clients of one worker share for their own control calls."""

from __future__ import annotations

import logging

import grpc

from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.kv_server_stubs import KVServerStubs
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

log = logging.getLogger("ray.serve." + __name__)


class KVControl:
    def __init__(self, max_chunk_bytes: int, timeout_s: float, idle_seconds: float = 60.0):
        """Every call has a `timeout_s` deadline; a channel unused for `idle_seconds` is
        closed; `max_chunk_bytes` sizes the channels' message limit (FetchKV shares them)."""
        self.timeout_s = timeout_s
        self.stubs = KVServerStubs(max_chunk_bytes, timeout_s, idle_seconds)

    async def release(self, handle: KVHandle, reason: str) -> bool:
        """ReleaseKV ("fetched" or "aborted"). Best effort: False if nothing was freed or the
        call failed (the lease then expires on its own)."""
        request = pb.ReleaseKVRequest(
            request_id=handle.request_id, capability_token=handle.capability_token, reason=reason
        )
        try:
            response = await self.stubs.stub(handle.endpoint).ReleaseKV(
                request, timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            _warn("ReleaseKV", handle.request_id, handle.endpoint, exc)
            return False
        return response.released

    async def cancel_prefill(self, endpoint: str, request_id: str, token: bytes) -> bool:
        """CancelPrefill `request_id` on the prefill worker at `endpoint`. Best effort: False
        if no lease was ended or the call failed."""
        request = pb.CancelPrefillRequest(request_id=request_id, cancel_token=token)
        try:
            response = await self.stubs.stub(endpoint).CancelPrefill(
                request, timeout=self.timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            _warn("CancelPrefill", request_id, endpoint, exc)
            return False
        return response.released

    async def close(self) -> None:
        """Close every channel (idempotent)."""
        await self.stubs.close()


def _warn(rpc: str, request_id: str, endpoint: str, exc: grpc.aio.AioRpcError) -> None:
    log.warning(
        "%s %s on %s failed: %s %s", rpc, request_id, endpoint, exc.code().name, exc.details()
    )
