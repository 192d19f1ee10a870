"""The decode pool's replica: pulls a prompt's KV from the prefill replica named in the handle,
joins the continuous batch and streams tokens.

The pull is this side's job (the prefill side never learns where decoding happens), so Serve's
own routing picks the replica in each pool. The engine reserves the prompt's blocks first and
the KV client writes the KV straight into them (`KVClient.fetch_into`; under `nixl` a READ from
the prefill pool into ours). A fetch that does not end within `fetch_timeout_seconds` fails
the call UNAVAILABLE, as an unreachable prefill replica does, so the router prefills the prompt
again. The lease is released as soon as the KV is in our pool: the ReleaseKV call runs while
the sequence joins the batch, so its round trip is not on the way to the second token. The
engine's output thread sends the tokens to the router's token server
(decode_worker/token_sender.py) while the Serve call stays open until the last one. A replica
being removed lets its streams finish within the graceful shutdown timeout and ends the rest
with finish reason "abort".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

from cluster.engine.engine import Engine
from cluster.errors import DeadlineExceeded, PdServeError, Unavailable
from cluster.kv_transfer.transport_factory import make_decode_client
from cluster.request import Request, StepOutput
from cluster.serving.app_config import AppConfig
from cluster.serving.metrics import PoolMetrics
from cluster.serving.pool_messages import DecodeRequest, TokenRoute, WorkerChunk
from cluster.serving.replica import EngineReplica
from decode_worker.token_sender import TokenSender


class DecodeWorker(EngineReplica):
    async def __init__(self, config: AppConfig) -> None:
        self._start(config, "decode")
        ranks: tuple[str, ...] = ()
        if self.tp is not None:  # KV moves into every rank's pool, each from its own server
            ranks = self.tp.rank_endpoints
            await self.engine.call(lambda e: setattr(e, "imports_every_rank", True))
        self.kv_client = make_decode_client(
            config.transfer,
            self.engine.device,
            self.engine.kv_pool,
            ranks,
            self.replica_secret,
        )
        self.tokens = TokenSender()

    async def decode(self, req: DecodeRequest, route: TokenRoute) -> None:
        """Hop 4: fetch the prompt's KV, import it into the batch and decode; the output thread
        sends every output to the router's token server (`route`). Returns once the last one
        was sent, so the Serve call lasts as long as the stream. Errors before the first output
        (bad lease, layout mismatch, full pool) are raised; cancelling the call aborts the
        request and frees its blocks."""
        started = time.monotonic()
        async with self._fetched(req) as (request, nbytes):
            stream = _DecodeStream(
                request, nbytes, req.first_token, started, self.replica_id, self.metrics
            )
            rid, interval = request.request_id, request.stream_interval
            async with self.tokens.sink(route, rid, stream.chunk, interval) as sink:
                await self.engine.stream_to(request.request_id, stream.admit, sink)

    @asynccontextmanager
    async def _fetched(self, req: DecodeRequest) -> AsyncIterator[tuple[Request, int]]:
        """Reserve blocks for the prompt's KV and fetch it into them: (request, KV bytes). The
        lease is released (best effort: a lost release expires) while the body imports it, and
        the release is awaited when the body ends. Blocks of an import the body did not finish
        (a failed fetch, a cancel) are freed."""
        request = replace(req.request, arrival_time=time.monotonic())
        rid = request.request_id
        try:
            block_ids = await self.engine.call(lambda e: e.reserve_import(request))
            try:
                pool = self.engine.kv_pool
                nbytes = await self.kv_client.fetch_into(req.handle, pool, block_ids)
            except PdServeError as e:
                self.metrics.inc("pdserve_kv_transfer_failures_total", code=e.grpc_code)
                if isinstance(e, DeadlineExceeded):
                    # The prefill replica did not deliver within fetch_timeout_seconds (gone,
                    # or cut off from this node): the router may prefill the prompt again.
                    raise Unavailable(e.message) from None
                raise
            released = asyncio.ensure_future(self.kv_client.release(req.handle, "fetched"))
            try:
                yield request, nbytes
            finally:
                await released
        except BaseException:
            await asyncio.shield(self.engine.call(lambda e: e.cancel_import(rid)))
            raise

    async def __del__(self) -> None:
        await self._shutdown()
        self.tokens.close()
        await self.kv_client.close()


@dataclass
class _DecodeStream:
    """One request's way into the batch and out to the router. `admit` runs on the engine
    thread (`AsyncEngine.stream_to`), `chunk` on its output thread (`StreamSink.put`): the
    first chunk carries the KV transfer time (from the call to the end of the import) and the
    queue time (from there to the first output) goes to the metrics."""

    request: Request
    kv_bytes: int
    first_token: int
    started: float
    replica_id: str
    metrics: PoolMetrics
    imported_at: float = 0.0

    def admit(self, engine: Engine) -> None:
        engine.finish_import(self.request.request_id, self.first_token)
        self.imported_at = time.monotonic()
        self.metrics.observe("pdserve_kv_transfer_time_seconds", self.transfer_seconds)
        self.metrics.inc("pdserve_kv_transfer_bytes_total", self.kv_bytes)

    @property
    def transfer_seconds(self) -> float:
        return self.imported_at - self.started

    def chunk(self, out: StepOutput, first: bool) -> WorkerChunk:
        if not first:
            return WorkerChunk(out, self.replica_id)
        self.metrics.observe("pdserve_queue_time_seconds", time.monotonic() - self.imported_at)
        return WorkerChunk(out, self.replica_id, kv_transfer_seconds=self.transfer_seconds)
