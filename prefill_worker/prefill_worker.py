"""The prefill pool's replica: computes prompts, returns the first token and a KV lease.

Requests that reach a replica together are prefilled together: the engine's scheduler packs
every waiting prompt into the same steps under its token budget (long prompts are chunked).
Each finished prompt's KV blocks stay pinned under a lease until a decode worker fetches them
through this replica's KV server, the router releases them (cancelled or aborted), or the lease
expires. A call cancelled on the way (the router cancels it when its client leaves) frees what
it holds: queued or prefilling, the engine aborts the prompt; prefilled, it is never leased. A
call that arrives after its `CancelPrefill` is dropped before the engine sees it
(`LeaseKeeper.cancelled`).

Scale-down is drain-safe: a replica that Serve is removing refuses new prompts (UNAVAILABLE,
so the router retries on another replica) and waits, up to its graceful shutdown timeout,
until every outstanding lease is fetched or has expired before its KV server stops.
"""

from __future__ import annotations

import time
from dataclasses import replace

from cluster.config import resolve_host
from cluster.errors import NotFound, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.request import Request
from cluster.serving.app import GRACEFUL_SHUTDOWN_S
from cluster.serving.app_config import AppConfig
from cluster.serving.pool_messages import PrefillResult, ReplicaStats
from cluster.serving.replica import EngineReplica
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper


class PrefillWorker(EngineReplica):
    async def __init__(self, config: AppConfig) -> None:
        self._start(config, "prefill")
        transfer = config.transfer
        self.leases = LeaseKeeper(
            self.engine, transfer.lease_seconds, Capability(bytes.fromhex(transfer.secret))
        )
        self.leases.start()
        self.server = KVServer(
            self.engine,
            self.leases,
            self.layout,
            resolve_host(transfer.host),
            transfer.port,
            transfer.max_chunk_bytes,
            transport=transfer.transport,
            channel_timeout_s=transfer.fetch_timeout_seconds,
            channel_idle_s=transfer.channel_idle_seconds,
        )
        self.endpoint = await self.server.start()
        ranks: tuple[str, ...] = ()
        if self.tp is not None:  # the other ranks' KV servers pin leases through this one
            self.tp.publish_leader(self.endpoint)
            ranks = self.tp.rank_endpoints
        self.rank_endpoints = ranks
        self.draining = False
        self._leases_reported: dict[str, int] = {}

    async def prefill(self, request: Request) -> PrefillResult:
        """Prefill one prompt. Raises InvalidArgument / ResourceExhausted from admission,
        Unavailable while this replica drains, NotFound if it was cancelled before it came."""
        if self.draining:
            raise Unavailable("prefill replica is shutting down; retry on another")
        if self.leases.cancelled.drop(request.request_id):
            raise NotFound(f"request {request.request_id!r} was cancelled before it arrived")
        received = time.monotonic()
        request = replace(request, prefill_only=True, arrival_time=received)
        first = None
        async for out in await self.engine.generate(request):
            first = out
        assert first is not None and first.finished
        handle = None
        if first.finish_reason == "prefilled":
            block_ids, num_tokens, expiry, token = await self.leases.grant(request.request_id)
            handle = KVHandle(
                request_id=request.request_id,
                num_tokens=num_tokens,
                endpoint=self.endpoint,
                transport=self.server.transport,
                block_ids=tuple(block_ids),
                block_size=self.layout.block_size,
                layout=self.layout,
                lease_expiry_unix=expiry,
                capability_token=token,
                first_token_id=first.token_ids[0],
                rank_endpoints=self.rank_endpoints,
            )
        prefill_seconds = time.monotonic() - received - first.queue_seconds
        self.metrics.observe("pdserve_queue_time_seconds", first.queue_seconds)
        self.metrics.observe("pdserve_prefill_time_seconds", prefill_seconds)
        return PrefillResult(
            first=first,
            handle=handle,
            replica_id=self.replica_id,
            queue_seconds=first.queue_seconds,
            prefill_seconds=prefill_seconds,
        )

    async def stats(self) -> ReplicaStats:
        return replace(
            await super().stats(),
            kv_leases_ended=dict(self.leases.ended),
            kv_endpoint=self.endpoint,
        )

    async def _report(self) -> None:
        await super()._report()
        ended = self.last_stats.kv_leases_ended
        for reason, count in ended.items():
            new = count - self._leases_reported.get(reason, 0)
            if reason == "expired":
                self.metrics.inc("pdserve_kv_leases_expired_total", new)
            else:
                self.metrics.inc("pdserve_kv_leases_released_total", new, reason=reason)
        self._leases_reported = ended

    async def __del__(self) -> None:
        self.draining = True
        # Leases outlive the prefill calls Serve waited for: let decode workers fetch them.
        await self.leases.drain(timeout=GRACEFUL_SHUTDOWN_S - 5.0)
        await self.server.stop(1.0)
        await self.leases.stop()
        await self._shutdown()
