"""How a router replica lists itself in `GetStats`: a `ReplicaStats` of pool "router" (every
figure 0; `grpc_endpoint`: its direct gRPC endpoint, `router.direct`, or "" when
`router.direct_grpc` is off) in the application's stats registry (cluster/serving/
stats_registry.py), put when the replica starts and again every REPORT_INTERVAL_S, so the
registry's TTL keeps it while the replica lives and drops it when the replica dies; removed
when the replica stops, before its endpoint stops taking calls."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from cluster.serving.pool_messages import ReplicaStats
from cluster.serving.stats_registry import REPORT_INTERVAL_S

log = logging.getLogger("ray.serve." + __name__)
POOL = "router"


class EndpointReporter:
    """Keeps one router replica's entry in `registry` (the stats registry actor's handle)."""

    def __init__(
        self,
        registry: Any,
        replica_id: str,
        grpc_endpoint: str,
        interval_s: float = REPORT_INTERVAL_S,
    ) -> None:
        self.registry = registry
        self.replica_id = replica_id
        self.grpc_endpoint = grpc_endpoint
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            pool=POOL,
            replica_id=self.replica_id,
            kv_blocks_total=0,
            kv_blocks_used=0,
            kv_blocks_leased=0,
            running=0,
            waiting=0,
            queued_prompt_tokens=0,
            updated_at=time.time(),
            grpc_endpoint=self.grpc_endpoint,
        )

    async def start(self) -> None:
        """Put the entry now (the replica is listed once it is up), then keep it fresh."""
        await self.registry.put.remote(self.stats())
        self._task = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.registry.put.remote(self.stats())
            except Exception:  # reporting must never take the replica down
                log.exception("router stats report failed")

    async def stop(self) -> None:
        """Stop refreshing and remove the entry (clients reading `GetStats` stop picking it)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(Exception):
            await self.registry.remove.remote(POOL, self.replica_id)
