"""A replica whose engine is still starting (a hub model downloading into its node's cache, the
weights loading) is listed with state "loading": in the stats registry while `_start` builds
the engine, in `GetStats`' message and in `pdserve status`' table and JSON. No Ray: the
registry is a double that records the calls, as the actor would receive them."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
from datetime import UTC, datetime

import pytest

import cluster.serving.replica as replica_module
from cluster.cli.status import Snapshot, render, show_status
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.serving.app import default_config
from cluster.serving.loading_report import LoadingReport
from cluster.serving.pool_messages import LOADING, READY, ReplicaStats
from cluster.serving.replica import EngineReplica
from router.grpc_api import stats_to_proto
from router.pool_status import ClusterStats


class _Registry:
    """`put.remote(stats)` / `remove.remote(pool, id)`, as sent to the actor (not awaited)."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], ReplicaStats] = {}
        self.puts: list[ReplicaStats] = []
        self.removed: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        registry = self

        class _Put:
            def remote(self, stats: ReplicaStats) -> None:
                with registry.lock:
                    registry.puts.append(stats)
                    registry.entries[(stats.pool, stats.replica_id)] = stats

        class _Remove:
            def remote(self, pool: str, replica_id: str) -> None:
                with registry.lock:
                    registry.removed.append((pool, replica_id))
                    registry.entries.pop((pool, replica_id), None)

        self.put, self.remove = _Put(), _Remove()


def test_the_entry_is_put_at_once_and_refreshed_until_the_engine_is_built():
    registry = _Registry()
    with LoadingReport(registry, "decode", "d0", interval_s=0.05):
        assert [s.state for s in registry.puts] == [LOADING]  # before any wait
        time.sleep(0.3)
    n = len(registry.puts)
    assert n >= 3 and {s.state for s in registry.puts} == {LOADING}
    s = registry.puts[-1]
    assert (s.pool, s.replica_id, s.kv_blocks_total, s.running, s.waiting) == (
        "decode",
        "d0",
        0,
        0,
        0,
    )
    assert [p.updated_at for p in registry.puts] == sorted(p.updated_at for p in registry.puts)
    time.sleep(0.15)
    assert len(registry.puts) == n and registry.removed == []  # stopped; left to the replica


def test_a_failed_start_removes_its_entry():
    registry = _Registry()
    with pytest.raises(RuntimeError, match="no weights"):
        with LoadingReport(registry, "prefill", "p0", interval_s=0.05):
            raise RuntimeError("no weights")
    assert registry.removed == [("prefill", "p0")] and registry.entries == {}


def test_a_replica_is_listed_loading_while_its_engine_is_built(monkeypatch):
    """`EngineReplica._start` itself: while the engine is built (here: a slow start that
    fails, as a download that cannot finish), the registry lists the replica as loading."""
    registry = _Registry()
    monkeypatch.setattr(replica_module, "registry", lambda name: registry)
    seen: list[list[ReplicaStats]] = []

    class SlowEngine:
        def __init__(self, config) -> None:
            time.sleep(1.3)  # past one REPORT_INTERVAL_S: the entry was refreshed
            seen.append(list(registry.entries.values()))
            raise RuntimeError("the download failed")

    monkeypatch.setattr(replica_module, "MeteredEngine", SlowEngine)
    switch = sys.getswitchinterval()
    try:
        with pytest.raises(RuntimeError, match="the download failed"):
            EngineReplica()._start(default_config(), "decode")
    finally:
        sys.setswitchinterval(switch)
    ((entry,),) = seen
    assert entry.pool == "decode" and entry.state == LOADING
    assert len(registry.puts) >= 2 and registry.entries == {}  # removed when the start failed


def test_getstats_carries_the_state():
    ready = ReplicaStats("decode", "d0", 64, 3, 0, 1, 0, 0)
    loading = ReplicaStats("decode", "d1", 0, 0, 0, 0, 0, 0, state=LOADING)
    assert ready.state == READY
    msg = stats_to_proto(ClusterStats((), (ready, loading)))
    assert [(r.replica_id, r.state) for r in msg.replicas] == [("d0", "ready"), ("d1", "loading")]


def _snapshot() -> Snapshot:
    info = pb.ModelInfo(model_id="org/m@0123456789ab", block_size=16, mode="disaggregated")
    stats = pb.ClusterStats(
        replicas=[
            pb.ReplicaStats(pool="decode", replica_id="d0", kv_blocks_total=64, state="ready"),
            pb.ReplicaStats(pool="decode", replica_id="d1", state="loading"),
            pb.ReplicaStats(pool="prefill", replica_id="p0", kv_blocks_total=64),  # no state
        ]
    )
    return Snapshot(info, stats, datetime(2026, 1, 2, tzinfo=UTC))


def test_status_shows_a_replica_still_loading():
    lines = render(_snapshot())
    header = next(line for line in lines if line.startswith("pool ") and "kv total" in line)
    assert header.split()[-1] == "state"
    rows = {
        line.split()[1]: line.split() for line in lines if line.startswith(("decode", "prefill"))
    }
    kv_total = header.split().index("kv")  # "kv total": the first "kv" column
    assert rows["d1"][-1] == "loading" and rows["d1"][kv_total] == "0"
    assert rows["d0"][-1] == "ready"
    assert rows["p0"][-1] == "ready"  # a server from before the field lists ready replicas only
    out = io.StringIO()
    assert show_status(_snapshot, as_json=True, watch=None, out=out) == 0
    states = {r["replica_id"]: r["state"] for r in json.loads(out.getvalue())["replicas"]}
    assert states == {"d0": "ready", "d1": "loading", "p0": ""}
