"""The colocated baseline: one pool of engines that prefill and decode the same request.

Same engine, same scheduler; the only difference from the disaggregated path is that no KV
moves. This is what disaggregation is measured against.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from cluster.app_config import AppConfig
from cluster.pool_messages import WorkerChunk
from cluster.replica import EngineReplica
from cluster.request import Request


class ColocatedWorker(EngineReplica):
    async def __init__(self, config: AppConfig) -> None:
        self._start(config, "colocated")

    async def generate(self, request: Request) -> AsyncIterator[WorkerChunk]:
        received = time.monotonic()
        stream = await self.engine.generate(replace(request, arrival_time=received))
        first = True
        async for out in stream:
            if first:
                prefill = time.monotonic() - received - out.queue_seconds
                self.metrics.observe("pdserve_queue_time_seconds", out.queue_seconds)
                self.metrics.observe("pdserve_prefill_time_seconds", prefill)
                yield WorkerChunk(
                    out, self.replica_id, queue_seconds=out.queue_seconds, prefill_seconds=prefill
                )
                first = False
            else:
                yield WorkerChunk(out, self.replica_id)

    async def __del__(self) -> None:
        await self._shutdown()
