"""Where every engine replica reports its KV and queue numbers, so `GetStats` can list them all.

Serve handles route each call to one replica, so the router cannot ask every replica itself.
Instead each worker pushes its `ReplicaStats` to one named Ray actor per application, on a short
timer and at shutdown; entries that stop arriving (a replica that died) age out after `ttl`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import ray

from cluster.pool_messages import ReplicaStats


@ray.remote(num_cpus=0)
class StatsRegistry:
    def __init__(self, ttl_seconds: float = 10.0) -> None:
        self.ttl = ttl_seconds
        self.entries: dict[tuple[str, str], ReplicaStats] = {}

    def put(self, stats: ReplicaStats) -> None:
        self.entries[(stats.pool, stats.replica_id)] = stats

    def remove(self, pool: str, replica_id: str) -> None:
        self.entries.pop((pool, replica_id), None)

    def list(self) -> list[ReplicaStats]:
        now = time.time()
        self.entries = {k: v for k, v in self.entries.items() if now - v.updated_at < self.ttl}
        return sorted(self.entries.values(), key=lambda s: (s.pool, s.replica_id))


def registry(app_name: str):
    """The application's registry actor, created by whoever asks first."""
    return StatsRegistry.options(
        name=f"pdserve-stats-{app_name}",
        namespace="pdserve",
        get_if_exists=True,
        lifetime="detached",
    ).remote()


class StatsReporter:
    """Pushes `collect()` to the registry every `interval` seconds while running."""

    def __init__(
        self, app_name: str, collect: Callable[[], asyncio.Future], interval: float = 0.25
    ) -> None:
        self.registry = registry(app_name)
        self.collect = collect
        self.interval = interval
        self._task: asyncio.Task | None = None
        self._last: ReplicaStats | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def push(self) -> None:
        stats: ReplicaStats = await self.collect()
        await self.registry.put.remote(stats)
        self._last = stats

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._last is not None:
            await self.registry.remove.remote(self._last.pool, self._last.replica_id)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.push()
            await asyncio.sleep(self.interval)
