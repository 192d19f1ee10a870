"""Where every engine replica reports its KV and queue numbers, and every router replica its
direct gRPC endpoint (router/endpoint_reporter.py), so `GetStats` can list them all.

Serve handles route each call to one replica, so the router cannot ask every replica itself.
Instead each engine replica pushes its `ReplicaStats` to one named Ray actor per application
whenever its figures change (sampled every 0.2 s) and at least once a second (see
`EngineReplica._report`), and removes itself at shutdown; entries that stop arriving (a replica
that died) age out after `ttl`.

The registry lives on the head node, as Serve's controller does: made by whichever replica
asks first, it would otherwise run on that replica's node and go with it, and `GetStats`
would fail on every router until the end of the application.
"""

from __future__ import annotations

import time

import ray

from cluster.serving.pool_messages import ReplicaStats

# Every replica pushes its entry again at least this often (engine replicas:
# `EngineReplica._report`; router replicas: router/endpoint_reporter.py), so no entry is older.
REPORT_INTERVAL_S = 1.0
# Ray gives this resource to the head node only.
HEAD_NODE_RESOURCE = "node:__internal_head__"


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


def registry_name(app_name: str) -> tuple[str, str]:
    """The application's registry actor's (name, namespace)."""
    return f"pdserve-stats-{app_name}", "pdserve"


def registry(app_name: str, attempts: int = 20):
    """The application's registry actor, created by whoever asks first. Replicas starting
    together race to create it: Ray can then answer a loser "Failed to look up actor" while
    the winner's is still being registered, so that is retried (for about 2 s)."""
    name, namespace = registry_name(app_name)
    for attempt in range(attempts):
        try:
            return StatsRegistry.options(
                name=name,
                namespace=namespace,
                get_if_exists=True,
                lifetime="detached",
                resources={HEAD_NODE_RESOURCE: 0.001},
            ).remote()
        except ValueError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.1)
