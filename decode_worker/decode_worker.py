"""The decode pool's replica: pulls a prompt's KV from the prefill replica named in the handle,
joins the continuous batch and streams tokens.

The pull is this side's job (the prefill side never learns where decoding happens), so Serve's
own routing picks the replica in each pool. The lease is released as soon as the KV is copied
into local memory, before the first decode step. A replica being removed lets its streams
finish within the graceful shutdown timeout and ends the rest with finish reason "abort".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from cluster.app_config import AppConfig
from cluster.direct_kv_client import make_kv_client
from cluster.errors import PdServeError
from cluster.pool_messages import DecodeRequest, WorkerChunk
from cluster.replica import EngineReplica


class DecodeWorker(EngineReplica):
    async def __init__(self, config: AppConfig) -> None:
        self._start(config, "decode")
        self.kv_client = make_kv_client(
            config.transfer, self.engine.engine.device, max_blocks=config.decode.cache.num_blocks
        )

    async def decode(self, req: DecodeRequest) -> AsyncIterator[WorkerChunk]:
        """Fetch, import, then yield one chunk per engine step until the request finishes.
        Errors before the first chunk (bad lease, layout mismatch, full pool) are raised."""
        started = time.monotonic()
        try:
            kv = await self.kv_client.fetch(req.handle, self.layout)
        except PdServeError as e:
            self.metrics.inc("pdserve_kv_transfer_failures_total", code=e.grpc_code)
            raise
        await self.kv_client.release(req.handle, "fetched")
        request = replace(req.request, arrival_time=time.monotonic())
        stream = await self.engine.import_and_generate(request, kv, req.first_token)
        transfer_seconds = time.monotonic() - started
        self.metrics.observe("pdserve_kv_transfer_time_seconds", transfer_seconds)
        self.metrics.inc("pdserve_kv_transfer_bytes_total", kv.k.nbytes + kv.v.nbytes)
        first = True
        async for out in stream:
            if first:
                queued = time.monotonic() - started - transfer_seconds
                self.metrics.observe("pdserve_queue_time_seconds", queued)
            yield WorkerChunk(
                out, self.replica_id, kv_transfer_seconds=transfer_seconds if first else 0.0
            )
            first = False

    async def __del__(self) -> None:
        await self._shutdown()
        await self.kv_client.close()
