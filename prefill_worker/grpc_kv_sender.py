"""`GrpcKVSender`: the prefill side of the `grpc` KV transport, behind `KVServer.FetchKV`.

It turns a pinned lease's blocks into `KVChunk` frames in wire form (`kv_wire.encode_frame`).
A producer task reads the chunks out of the pool, up to `read_batch_bytes` per read, and frames
them, on worker threads, while earlier frames are sent; at most two framed chunks wait for the
socket. The reads run beside the engine thread (`AsyncEngine.read_held_kv`), so a fetch never
waits for a prefill step to end.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.kv_cache import KVLayout
from cluster.kv_transfer.kv_wire import (
    ChunkRange,
    chunk_header,
    chunk_ranges,
    encode_frame,
    gather_chunks,
    unit_bytes,
)


class GrpcKVSender:
    def __init__(self, async_engine: AsyncEngine, layout: KVLayout, read_batch_bytes: int) -> None:
        self.engine = async_engine
        self.layout = layout
        self.unit_bytes = unit_bytes(layout)
        self.read_batch_bytes = read_batch_bytes

    async def frames(
        self, request_id: str, block_ids: list[int], max_chunk_bytes: int
    ) -> AsyncIterator[bytes]:
        """The chunks of the lease of `request_id` on `block_ids`, which the caller keeps pinned
        until the stream ends, each at most `max_chunk_bytes` of KV."""
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
                pieces = await asyncio.to_thread(self._read, request_id, block_ids, batch)
                for r, data in zip(batch, pieces, strict=True):
                    await frames.put(await asyncio.to_thread(_frame, r, data, self.layout.dtype))
            await frames.put(None)
        except Exception as exc:  # handed to the stream, which fails the RPC with it
            await frames.put(exc)

    def _read(self, request_id: str, block_ids: list[int], ranges: list[ChunkRange]):
        """Worker thread: copies of the chunks `ranges` of the lease's blocks."""
        return self.engine.read_held_kv(
            request_id, block_ids, lambda pool: gather_chunks(pool.k, pool.v, block_ids, ranges)
        )


def _frame(r: ChunkRange, data, dtype: str) -> bytes:
    return encode_frame(chunk_header(r, data, dtype), data)
