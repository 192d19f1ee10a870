"""The decode pool's replica: pulls a prompt's KV from the prefill replica named in the handle,
joins the continuous batch and streams tokens.

The pull is this side's job (the prefill side never learns where decoding happens), so Serve's
own routing picks the replica in each pool. The lease is released as soon as the KV is copied
into local memory: the ReleaseKV call runs while the KV is imported, so its round trip is not
on the way to the second token. Tokens go to the router over the direct token stream
(`decode_to`, the default) or back through the Serve handle (`decode`, the app's
`token_stream: serve`). A replica being removed lets its streams finish within the graceful
shutdown timeout and ends the rest with finish reason "abort".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

from cluster.engine.kv_cache import KVExport
from cluster.errors import PdServeError
from cluster.kv_transfer.collective_kv_client import make_kv_client
from cluster.request import Request, StepOutput
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_messages import DecodeRequest, TokenRoute, WorkerChunk
from cluster.serving.replica import EngineReplica
from decode_worker.token_sender import TokenSender


class DecodeWorker(EngineReplica):
    async def __init__(self, config: AppConfig) -> None:
        self._start(config, "decode")
        self.kv_client = make_kv_client(
            config.transfer, self.engine.engine.device, max_blocks=config.decode.cache.num_blocks
        )
        self.tokens = TokenSender()

    async def decode(self, req: DecodeRequest) -> AsyncIterator[WorkerChunk]:
        """Fetch, import, then yield one chunk per engine step until the request finishes.
        Errors before the first chunk (bad lease, layout mismatch, full pool) are raised."""
        started = time.monotonic()
        async with self._fetched(req) as (request, kv):
            stream = await self.engine.import_and_generate(request, kv, req.first_token)
            transfer_seconds = self._transferred(started, time.monotonic(), kv)
            first = True
            async for out in stream:
                if first:
                    self._queued(time.monotonic() - started - transfer_seconds)
                yield WorkerChunk(
                    out, self.replica_id, kv_transfer_seconds=transfer_seconds if first else 0.0
                )
                first = False

    async def decode_to(self, req: DecodeRequest, route: TokenRoute) -> None:
        """Fetch and import as `decode` does, then send every output to the router's token
        server (`route`) from the engine thread; return once the last one was sent. Errors
        before the first output are raised, as from `decode`."""
        started = time.monotonic()
        async with self._fetched(req) as (request, kv):
            marks: dict[str, float] = {}

            def admit(engine) -> None:  # engine thread, like `make`
                engine.import_kv(request, kv, req.first_token)
                marks["imported"] = time.monotonic()
                marks["transfer"] = self._transferred(started, marks["imported"], kv)

            def make(out: StepOutput, first: bool) -> WorkerChunk:
                if not first:
                    return WorkerChunk(out, self.replica_id)
                self._queued(time.monotonic() - marks["imported"])
                return WorkerChunk(out, self.replica_id, marks["transfer"])

            sink = await self.tokens.open(route, request.request_id, make)
            try:
                await self.engine.stream_to(request.request_id, admit, sink)
            finally:
                self.tokens.discard(sink)

    @asynccontextmanager
    async def _fetched(self, req: DecodeRequest) -> AsyncIterator[tuple[Request, KVExport]]:
        """Fetch the prompt's KV; the lease is released (best effort: a lost release expires)
        while the body imports it, and the release is awaited when the body ends."""
        try:
            kv = await self.kv_client.fetch(req.handle, self.layout)
        except PdServeError as e:
            self.metrics.inc("pdserve_kv_transfer_failures_total", code=e.grpc_code)
            raise
        released = asyncio.ensure_future(self.kv_client.release(req.handle, "fetched"))
        try:
            yield replace(req.request, arrival_time=time.monotonic()), kv
        finally:
            await released

    def _transferred(self, started: float, imported: float, kv: KVExport) -> float:
        seconds = imported - started
        self.metrics.observe("pdserve_kv_transfer_time_seconds", seconds)
        self.metrics.inc("pdserve_kv_transfer_bytes_total", kv.k.nbytes + kv.v.nbytes)
        return seconds

    def _queued(self, seconds: float) -> None:
        self.metrics.observe("pdserve_queue_time_seconds", seconds)

    async def __del__(self) -> None:
        await self._shutdown()
        self.tokens.close()
        await self.kv_client.close()
