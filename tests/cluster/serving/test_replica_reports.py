"""An engine replica publishes its stats as soon as they change and at least once a second, and
nothing more often than it samples (`EngineReplica._report`; no Ray: the registry is a double)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from cluster.serving.pool_messages import ReplicaStats
from cluster.serving.replica import REPORT_INTERVAL_S, SAMPLE_INTERVAL_S, EngineReplica

IDLE = ReplicaStats("decode", "d0", 64, 0, 0, running=0, waiting=0, queued_prompt_tokens=0)


class _Registry:
    def __init__(self) -> None:
        self.put = self  # `registry.put.remote(stats)`, as on the Ray actor
        self.pushed: list[ReplicaStats] = []

    async def remote(self, stats: ReplicaStats) -> None:
        self.pushed.append(stats)


class _Metrics:
    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}

    def set(self, name: str, value: float) -> None:
        self.gauges[name] = value


def _replica() -> EngineReplica:
    r = object.__new__(EngineReplica)
    r.registry, r.metrics = _Registry(), _Metrics()
    r.last_stats = r._pushed = None
    return r


def _samples(r: EngineReplica, samples: list[ReplicaStats]) -> list[ReplicaStats]:
    """Run one `_report` per sample (each what the engine shows then); return what was pushed."""

    async def run() -> None:
        for s in samples:

            async def stats(s=s) -> ReplicaStats:
                return s

            r.stats = stats
            await r._report()
            assert r.last_stats is s  # the autoscaling hook always sees the latest sample

    asyncio.run(run())
    return r.registry.pushed


def test_a_change_is_pushed_at_once_and_unchanged_figures_are_not():
    t = [1000.0 + i * SAMPLE_INTERVAL_S for i in range(4)]
    busy = replace(IDLE, kv_blocks_used=3, running=2, updated_at=t[2])
    samples = [
        replace(IDLE, updated_at=t[0]),
        replace(IDLE, updated_at=t[1]),
        busy,
        replace(busy, updated_at=t[3]),
    ]
    r = _replica()
    assert _samples(r, samples) == [samples[0], busy]
    assert r.metrics.gauges["pdserve_running_sequences"] == 2
    assert r.record_autoscaling_stats()["running"] == 2.0


def test_unchanged_figures_are_pushed_again_within_the_report_interval():
    n = round(3 * REPORT_INTERVAL_S / SAMPLE_INTERVAL_S)
    samples = [replace(IDLE, updated_at=1000.0 + i * SAMPLE_INTERVAL_S) for i in range(n + 1)]
    pushed = _samples(_replica(), samples)
    stamps = [s.updated_at for s in pushed]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert pushed[0] is samples[0] and len(pushed) >= 3
    assert all(SAMPLE_INTERVAL_S < g <= REPORT_INTERVAL_S + 1e-6 for g in gaps), gaps
    assert samples[-1].updated_at - stamps[-1] <= REPORT_INTERVAL_S
