"""`GrpcKVSender`: the prefill side of the `grpc` KV transport (contract: `KVSender`), which
every KV server serves: the FetchKV RPC.

`FetchKV` checks the handle and pins its lease (`lease_pins.pin`) for the whole stream, then streams
the KV of the lease in chunks of at most the server's `max_chunk_bytes` (or the client's, if
smaller). It turns a pinned lease's blocks into `KVChunk` frames in wire form
(`kv_frame.encode_frame`). A producer task reads the chunks out of the pool, up to
`read_batch_bytes` per read, and frames them, on worker threads, while earlier frames are sent; at
most two framed chunks wait for the socket. Without checksums, a chunk whose blocks are consecutive
in a host pool is framed straight from the pool (`kv_wire.pool_slices`): one copy of each byte on
this side. The reads run beside the engine thread (`AsyncEngine.read_held_kv`), so a fetch never
waits for a prefill step to end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import torch

from cluster.engine.kv_cache import KVLayout
from cluster.errors import InvalidArgument, PdServeError
from cluster.kv_transfer.base import KVSender
from cluster.kv_transfer.kv_frame import encode_frame
from cluster.kv_transfer.kv_wire import (
    ChunkRange,
    PoolSlices,
    chunk_header,
    chunk_ranges,
    encode_chunks,
    gather_chunks,
    pool_slices,
    unit_bytes,
)
from cluster.kv_transfer.lease_pins import SenderParts, abort, pin_slice
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb


class GrpcKVSender(KVSender):
    def __init__(self, parts: SenderParts) -> None:
        """InvalidArgument if `parts.max_chunk_bytes` is below one block of one layer."""
        self.parts = parts
        self.engine = parts.async_engine
        self.layout = parts.layout
        self.unit_bytes = unit_bytes(parts.layout)
        self.read_batch_bytes = parts.read_batch_bytes
        self.max_chunk_bytes = parts.max_chunk_bytes
        if self.max_chunk_bytes < self.unit_bytes:
            raise InvalidArgument(
                f"max_chunk_bytes={self.max_chunk_bytes} is below one block of one layer "
                f"({self.unit_bytes} bytes)"
            )

    def handlers(self) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
        """FetchKV, registered without a response serializer: its handler yields `KVChunk`
        messages already framed (`kv_frame`), which protobuf would copy twice more."""
        fetch = grpc.unary_stream_rpc_method_handler(
            self.FetchKV, request_deserializer=pb.FetchKVRequest.FromString
        )
        return {self.SERVICE: {"FetchKV": fetch}}

    async def FetchKV(
        self, request: pb.FetchKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        try:
            rid, block_ids, receiver = await pin_slice(self.parts, request)
        except PdServeError as exc:
            await abort(context, exc)
        try:
            limit = request.max_chunk_bytes or self.max_chunk_bytes
            if receiver != self.layout:
                frames = self.slice_frames(rid, block_ids, receiver, limit)
            else:
                limit = max(min(limit, self.max_chunk_bytes), self.unit_bytes)
                frames = self.frames(rid, block_ids, limit, request.checksum)
            async for frame in frames:
                yield frame
        except PdServeError as exc:
            await abort(context, exc)
        finally:
            self.parts.leases.end_fetch(rid)

    async def frames(
        self, request_id: str, block_ids: list[int], max_chunk_bytes: int, checksum: bool = False
    ) -> AsyncIterator[bytes]:
        """The chunks of the lease of `request_id` on `block_ids`, which the caller keeps pinned
        until the stream ends, each at most `max_chunk_bytes` of KV; with `checksum`, each
        header carries its data's checksum."""
        frames: asyncio.Queue[bytes | Exception | None] = asyncio.Queue(maxsize=2)
        producer = asyncio.create_task(
            self._produce(request_id, block_ids, max_chunk_bytes, checksum, frames)
        )
        try:
            while (frame := await frames.get()) is not None:
                if isinstance(frame, Exception):
                    raise frame
                yield frame
        finally:
            producer.cancel()
            await asyncio.gather(producer, return_exceptions=True)

    async def slice_frames(
        self,
        request_id: str,
        block_ids: list[int],
        heads: KVLayout,
        max_chunk_bytes: int,
    ) -> AsyncIterator[bytes]:
        """The chunks of a head slice of the lease's KV (`heads`, checked by `pin_slice`), for a
        rank of another TP size: the slice is copied out of the pool under the pin, then framed.
        Blocks are numbered in the lease's order, as in a whole fetch."""
        h0 = heads.kv_head_start - self.layout.kv_head_start
        h1 = h0 + heads.num_kv_heads
        limit = max(min(max_chunk_bytes, self.max_chunk_bytes), unit_bytes(heads))

        def read(pool):
            idx = torch.tensor(block_ids, dtype=torch.long, device=pool.k.device)
            k, v = (t.index_select(1, idx)[:, :, :, h0:h1].contiguous() for t in (pool.k, pool.v))
            return k.cpu(), v.cpu()

        k, v = await asyncio.to_thread(self.engine.read_held_kv, request_id, block_ids, read)
        frames = await asyncio.to_thread(
            lambda: [encode_frame(header, data) for header, data in encode_chunks(k, v, limit)]
        )
        for frame in frames:  # every header carries its checksum, asked for or not
            yield frame

    async def _produce(
        self,
        request_id: str,
        block_ids: list[int],
        max_chunk_bytes: int,
        checksum: bool,
        frames: asyncio.Queue[bytes | Exception | None],
    ) -> None:
        try:
            ranges = chunk_ranges(
                self.layout.num_layers, len(block_ids), self.unit_bytes, max_chunk_bytes
            )
            per_read = max(1, self.read_batch_bytes // max_chunk_bytes)
            for i in range(0, len(ranges), per_read):
                batch = ranges[i : i + per_read]
                pieces = await asyncio.to_thread(self._read, request_id, block_ids, batch, checksum)
                for r, data in zip(batch, pieces, strict=True):
                    frame = await asyncio.to_thread(_frame, r, data, self.layout.dtype, checksum)
                    await frames.put(frame)
            await frames.put(None)
        except Exception as exc:  # handed to the stream, which fails the RPC with it
            await frames.put(exc)

    def _read(
        self, request_id: str, block_ids: list[int], ranges: list[ChunkRange], checksum: bool
    ):
        """Worker thread: the chunks `ranges` of the lease's blocks, as views into the pool
        (read while the caller's pin lasts) where framing may copy straight from it, else as
        gathered copies."""

        def read(pool):
            if not checksum:
                views = [pool_slices(pool.k, pool.v, block_ids, r) for r in ranges]
                if all(view is not None for view in views):
                    return views
            return gather_chunks(pool.k, pool.v, block_ids, ranges)

        return self.engine.read_held_kv(request_id, block_ids, read)


def _frame(r: ChunkRange, data, dtype: str, checksum: bool) -> bytes:
    body = data.pieces if isinstance(data, PoolSlices) else data
    return encode_frame(chunk_header(r, data, dtype, checksum), body)
