"""What every engine replica shares: identity, torch threads, its engine thread, health,
and the stats it reports for `GetStats`."""

from __future__ import annotations

import os
import time
import uuid

import torch

from cluster.app_config import AppConfig
from cluster.async_engine import AsyncEngine
from cluster.engine import Engine
from cluster.pool_messages import ReplicaStats
from cluster.stats_registry import StatsReporter


def replica_id() -> str:
    """Serve's replica id when running inside Serve, else a process-unique id."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return f"local-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EngineReplica:
    """Base of the prefill, decode and colocated deployments. Subclasses call `_start`."""

    pool: str

    def _start(self, config: AppConfig, pool: str) -> None:
        self.pool = pool
        threads = (config.prefill if pool == "prefill" else config.decode).torch_threads
        if threads > 0:
            torch.set_num_threads(threads)
        self.config = config
        self.replica_id = replica_id()
        self.engine = AsyncEngine(Engine(config.engine_config(pool)))
        self.engine.start()
        self.layout = self.engine.engine.layout
        self.reporter = StatsReporter(config.name, self.stats)
        self.reporter.start()

    async def stats(self) -> ReplicaStats:
        s = await self.engine.call(lambda e: e.stats())
        return ReplicaStats(
            pool=self.pool,
            replica_id=self.replica_id,
            kv_blocks_total=s.kv_blocks_total,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_leased=s.kv_blocks_held,
            running=s.running,
            waiting=s.waiting,
            queued_prompt_tokens=s.queued_prompt_tokens,
            updated_at=time.time(),
        )

    async def check_health(self) -> None:
        """Serve's health probe: the engine thread must be alive."""
        if not self.engine.alive():
            raise RuntimeError("engine thread is not running")

    async def _shutdown(self) -> None:
        await self.reporter.stop()
        await self.engine.stop()
