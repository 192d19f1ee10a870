"""The colocated baseline: one pool of engines that prefill and decode the same request.

Same engine, same scheduler; the only difference from the disaggregated path is that no KV
moves. This is what disaggregation is measured against. Tokens reach the router as from a
decode worker: sent by the engine's output thread to the router's token server.
"""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

from cluster.request import Request, StepOutput
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_messages import TokenRoute, WorkerChunk
from cluster.serving.replica import EngineReplica
from decode_worker.token_sender import TokenSender


class ColocatedWorker(EngineReplica):
    async def __init__(self, config: AppConfig) -> None:
        self._start(config, "colocated")
        self.tokens = TokenSender()

    async def generate(self, request: Request, route: TokenRoute) -> None:
        """Hops 2-4 in one engine: prefill and decode `request`; the output thread sends every
        output to the router's token server (`route`). Returns once the last one was sent, so
        the Serve call lasts as long as the stream; cancelling it aborts the request."""
        received = time.monotonic()
        request = replace(request, arrival_time=received)
        chunk = partial(self._chunk, received=received)
        rid, interval = request.request_id, request.stream_interval
        async with self.tokens.sink(route, rid, chunk, interval) as sink:
            await self.engine.stream_to(request.request_id, lambda e: e.add_request(request), sink)

    def _chunk(self, out: StepOutput, first: bool, received: float) -> WorkerChunk:
        """Output thread: the first chunk carries the phase times (and records them in the
        metrics)."""
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
