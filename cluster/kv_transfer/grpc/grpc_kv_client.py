"""`GrpcKVClient`: the decode worker's end of the `grpc` KV transport (contract: `KVClient`).

`fetch` streams the KV named by a `KVHandle` from the prefill worker's `KVServer` (FetchKV) and
checks it chunk by chunk against the receiver's own layout (`kv_wire.ChunkAssembler`) before
copying; `fetch_into` copies each chunk straight into the caller's (host) pool blocks, the one
copy on this side. Chunk checksums are asked for and checked only with `checksum`. `release`
is a ReleaseKV call (`KVControl`, whose channels to the servers, `KVServerStubs`, FetchKV
shares).
"""

from __future__ import annotations

import asyncio

import grpc

from cluster.engine.kv_cache import KVCache, KVExport, KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument, Unavailable
from cluster.kv_transfer.base import KVClient, settle
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_frame import decode_frame
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto
from cluster.kv_transfer.kv_server_stubs import rpc_error
from cluster.kv_transfer.kv_wire import ChunkAssembler, unit_bytes
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb


class GrpcKVClient(KVClient):
    def __init__(
        self,
        max_chunk_bytes: int,
        timeout_s: float,
        *,
        max_blocks: int = 1 << 16,
        idle_seconds: float = 60.0,
        checksum: bool = False,
        control: KVControl | None = None,
    ):
        """`max_blocks` caps the KV one fetch may allocate (the decode pool's size is apt);
        every call has a `timeout_s` deadline; a channel unused for `idle_seconds` is closed;
        with `checksum` every chunk's checksum is asked for and checked. `control`: the
        channels to share with other clients (by default, its own)."""
        if min(max_chunk_bytes, timeout_s, max_blocks, idle_seconds) <= 0:
            raise InvalidArgument(
                "max_chunk_bytes, timeout_s, max_blocks and idle_seconds must be positive"
            )
        self.max_chunk_bytes = max_chunk_bytes
        self.timeout_s = timeout_s
        self.max_blocks = max_blocks
        self.checksum = checksum
        self.control = control or KVControl(max_chunk_bytes, timeout_s, idle_seconds)
        self.stubs = self.control.stubs

    async def fetch(self, handle: KVHandle, receiver_layout: KVLayout) -> KVExport:
        """The KV of `handle`, checked against `receiver_layout`. The lease stays held."""
        return await self._stream(handle, receiver_layout, None)

    async def fetch_into(self, handle: KVHandle, pool: KVCache, block_ids: list[int]) -> int:
        """The KV of `handle`, each chunk copied straight into `block_ids` of `pool` (a GPU
        pool: fetched, then copied in). Waits for its copies even if cancelled."""
        if pool.k.device.type != "cpu":
            return await super().fetch_into(handle, pool, block_ids)
        await self._stream(handle, pool.layout, (pool.k, pool.v, block_ids))
        return len(block_ids) * pool.layout.num_layers * unit_bytes(pool.layout)

    async def fetch_heads(self, handle: KVHandle, rank: int, heads: KVLayout) -> KVExport:
        """The KV heads `heads` names (a head slice of the pool of rank `rank` of the prefill
        replica; `tp_ranks.head_plan`), from that rank's KV server. The lease stays held."""
        if not heads.same_model(handle.layout) or not 0 <= rank < handle.layout.tp_size:
            raise FailedPrecondition(
                f"KV heads {heads} are not of the model of the handle's layout {handle.layout}"
            )
        return await self._stream(handle, heads, None, handle.rank_endpoint(rank))

    async def _stream(
        self, handle: KVHandle, layout: KVLayout, into, endpoint: str | None = None
    ) -> KVExport:
        if endpoint is None:
            layout.check_matches(handle.layout)
        if unit_bytes(layout) > self.max_chunk_bytes:
            raise FailedPrecondition(
                f"max_chunk_bytes={self.max_chunk_bytes} is below one block of one layer"
            )
        assembler = ChunkAssembler(
            layout,
            len(handle.block_ids),
            handle.num_tokens,
            self.max_blocks,
            verify_checksum=self.checksum,
            into=into,
        )
        request = pb.FetchKVRequest(
            handle=handle.to_proto(),
            receiver_layout=layout_to_proto(layout),
            max_chunk_bytes=self.max_chunk_bytes,
            checksum=self.checksum,
        )
        endpoint = endpoint or handle.endpoint
        call = self.stubs.fetch_kv(endpoint)(request, timeout=self.timeout_s)
        loop = asyncio.get_running_loop()
        adding: asyncio.Future | None = None  # never cancelled: a copy may be writing a pool
        try:
            # Each chunk is checked and copied on a worker thread while the next one arrives.
            async for frame in call:
                if adding is not None:
                    await asyncio.shield(adding)
                adding = loop.run_in_executor(None, assembler.add, *decode_frame(frame))
            if adding is not None:
                await asyncio.shield(adding)
            return assembler.finish()
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(exc, handle) from None
        except InvalidArgument as exc:
            raise Unavailable(
                f"malformed KV stream from {endpoint} for request "
                f"{handle.request_id!r}: {exc.message}"
            ) from None
        finally:
            if not call.done():
                call.cancel()
            if adding is not None:
                await settle(asyncio.gather(adding, return_exceptions=True))

    async def release(self, handle: KVHandle, reason: str) -> bool:
        """ReleaseKV, as for every transport (`KVControl.release`)."""
        return await self.control.release(handle, reason)

    async def close(self) -> None:
        await self.control.close()
