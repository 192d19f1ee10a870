"""The colocated baseline: one pool of engines that prefill and decode the same request.

Same engine, same scheduler; the only difference from the disaggregated path is that no KV
moves. This is what disaggregation is measured against. Tokens reach the router the same two
ways as from a decode worker: the direct token stream (`generate_to`) or the Serve handle
(`generate`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from cluster.request import Request, StepOutput
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_messages import TokenRoute, WorkerChunk
from cluster.serving.replica import EngineReplica
from decode_worker.token_sender import TokenSender


class ColocatedWorker(EngineReplica):
    async def __init__(self, config: AppConfig) -> None:
        self._start(config, "colocated")
        self.tokens = TokenSender()

    async def generate(self, request: Request) -> AsyncIterator[WorkerChunk]:
        received = time.monotonic()
        stream = await self.engine.generate(replace(request, arrival_time=received))
        first = True
        async for out in stream:
            yield self._chunk(out, first, received)
            first = False

    async def generate_to(self, request: Request, route: TokenRoute) -> None:
        """Generate, sending every output to the router's token server from the engine
        thread; return once the last one was sent."""
        received = time.monotonic()
        request = replace(request, arrival_time=received)

        def make(out: StepOutput, first: bool) -> WorkerChunk:
            return self._chunk(out, first, received)

        sink = await self.tokens.open(route, request.request_id, make)
        try:
            await self.engine.stream_to(request.request_id, lambda e: e.add_request(request), sink)
        finally:
            self.tokens.discard(sink)

    def _chunk(self, out: StepOutput, first: bool, received: float) -> WorkerChunk:
        """The first chunk carries the phase times (and records them in the metrics)."""
        if not first:
            return WorkerChunk(out, self.replica_id)
        prefill = time.monotonic() - received - out.queue_seconds
        self.metrics.observe("pdserve_queue_time_seconds", out.queue_seconds)
        self.metrics.observe("pdserve_prefill_time_seconds", prefill)
        return WorkerChunk(
            out, self.replica_id, queue_seconds=out.queue_seconds, prefill_seconds=prefill
        )

    async def __del__(self) -> None:
        await self._shutdown()
        self.tokens.close()
