"""A router replica's entry in the stats registry (router/endpoint_reporter.py): put at start
with its direct endpoint, refreshed while it runs (so the registry's TTL keeps it), removed at
stop and not put again."""

from __future__ import annotations

import asyncio

from cluster.serving.pool_messages import ReplicaStats
from router.endpoint_reporter import EndpointReporter


class Remote:
    """Stands in for an actor method: `.remote(...)` records the call and is awaitable."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class FakeRegistry:
    def __init__(self) -> None:
        self.puts: list[tuple[ReplicaStats]] = []
        self.removes: list[tuple[str, str]] = []
        self.put = Remote(self.puts)
        self.remove = Remote(self.removes)


def test_the_router_is_listed_at_start_kept_fresh_and_removed_at_stop():
    registry = FakeRegistry()

    async def run() -> int:
        reporter = EndpointReporter(registry, "r0", "127.0.0.1:41000", interval_s=0.02)
        await reporter.start()
        assert len(registry.puts) == 1  # listed before the replica is up
        await asyncio.sleep(0.2)
        await reporter.stop()
        at_stop = len(registry.puts)
        await asyncio.sleep(0.1)
        assert len(registry.puts) == at_stop  # no refresh after stop
        return at_stop

    puts = asyncio.run(run())
    assert puts >= 4
    stats = [s for (s,) in registry.puts]
    assert {(s.pool, s.replica_id, s.grpc_endpoint) for s in stats} == {
        ("router", "r0", "127.0.0.1:41000")
    }
    assert all(s.kv_blocks_total == s.running == s.queued_prompt_tokens == 0 for s in stats)
    assert stats[-1].updated_at > stats[0].updated_at  # each refresh is a fresh stamp
    assert registry.removes == [("router", "r0")]


def test_a_failed_refresh_does_not_stop_the_reports():
    registry = FakeRegistry()
    failing = registry.put
    fails = iter([True, False, False, False, False, False, False, False])

    class Flaky:
        def remote(self, stats):
            if next(fails, False):
                raise ConnectionError("registry restarting")
            return failing.remote(stats)

    async def run() -> None:
        reporter = EndpointReporter(registry, "r0", "", interval_s=0.02)
        await reporter.start()
        registry.put = Flaky()
        await asyncio.sleep(0.2)
        await reporter.stop()

    asyncio.run(run())
    assert len(registry.puts) >= 3
