"""`LoadingReport`: an engine replica is listed by `GetStats` and `pdserve status` while its
engine starts, with state LOADING and every figure 0. A hub model's weights download into the
node's cache and then load, which can take minutes; until the constructor returns, Serve does
not count the replica as running and its engine has no figures to report.

The constructor builds the engine on the replica's event loop thread, so the report runs on a
thread of its own: it puts the entry into the stats registry at once, then every
REPORT_INTERVAL_S (so it never ages out of the registry) until the engine is built, when the
replica's own reports (`EngineReplica._report`) take over. If the start fails the entry is
removed; a replica that dies starting ages out with the registry's TTL.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from cluster.serving.pool_messages import LOADING, ReplicaStats
from cluster.serving.stats_registry import REPORT_INTERVAL_S

log = logging.getLogger("ray.serve." + __name__)


class LoadingReport:
    """A context manager around an engine's start (`EngineReplica._start`). `registry` is the
    app's stats registry actor; its calls are sent and not awaited (the caller's loop is
    busy), each a few bytes."""

    def __init__(
        self,
        registry: Any,
        pool: str,
        replica_id: str,
        interval_s: float = REPORT_INTERVAL_S,
        tensor_parallel_size: int = 1,
    ) -> None:
        self.registry, self.pool, self.replica_id = registry, pool, replica_id
        self.tensor_parallel_size = tensor_parallel_size
        self.interval_s = interval_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-loading", daemon=True)

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            self.pool, self.replica_id, 0, 0, 0, 0, 0, 0, updated_at=time.time(),
            tensor_parallel_size=self.tensor_parallel_size, state=LOADING,
        )  # fmt: skip

    def __enter__(self) -> LoadingReport:
        self._put()
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._done.set()
        self._thread.join()
        if exc_type is not None:
            try:
                self.registry.remove.remote(self.pool, self.replica_id)
            except Exception:
                log.exception("could not remove the loading entry")

    def _run(self) -> None:
        while not self._done.wait(self.interval_s):
            self._put()

    def _put(self) -> None:
        try:
            self.registry.put.remote(self.stats())
        except Exception:  # reporting must never take the start down
            log.exception("loading report failed")
