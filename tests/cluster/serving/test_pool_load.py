"""Every load signal (`pool_load.LoadSignals`'s fields) reaches Serve's autoscaler, `GetStats`
and the gauges, so a signal added there cannot be forgotten on one of the three ways out; and a
signal nobody reports is an error, never a silent 0."""

from __future__ import annotations

import asyncio
import math
from dataclasses import fields
from types import SimpleNamespace

import pytest

from cluster.serving.autoscaling import ENGINE_SIGNALS, SIGNALS, AutoscalingSettings, PoolLoadPolicy
from cluster.serving.metrics import METRICS
from cluster.serving.pool_load import SIGNAL_NAMES, LoadSignals, pool_load
from cluster.serving.pool_messages import ReplicaStats
from cluster.serving.replica import EngineReplica
from router.grpc_api import stats_to_proto
from router.pool_status import ClusterStats, PoolStatus, pool_signals

# Two decode replicas, every figure different, so a signal read from the wrong figure shows.
A = ReplicaStats("decode", "a", 64, 16, 0, running=3, waiting=1, queued_prompt_tokens=40)
B = ReplicaStats("decode", "b", 32, 24, 0, running=5, waiting=0, queued_prompt_tokens=7)
# Each signal computed by hand from the figures, not by the code under test.
BY_HAND = {
    "queued_prompt_tokens": (40.0, 7.0),
    "running": (3.0, 5.0),
    "kv_usage": (16 / 64, 24 / 32),
}
# A target on every signal: what a pool scaling on all of them is configured with.
EVERY = tuple((name, 1.0 + i) for i, name in enumerate(SIGNAL_NAMES))


def test_the_signals_are_the_dataclass_fields_and_the_only_names_a_target_may_use():
    assert SIGNAL_NAMES == tuple(f.name for f in fields(LoadSignals)) == ENGINE_SIGNALS
    assert set(SIGNALS) == {*SIGNAL_NAMES, "requests"}  # + Serve's own request count
    assert set(BY_HAND) == set(SIGNAL_NAMES), "a new signal needs its figure in BY_HAND"
    AutoscalingSettings(targets=EVERY)  # every signal is a target a config may set


def test_one_replicas_signals_are_computed_from_its_stats():
    for stats, column in ((A, 0), (B, 1)):
        assert LoadSignals.of(stats).as_dict() == {n: v[column] for n, v in BY_HAND.items()}


def _replica(stats: ReplicaStats):
    """An `EngineReplica` without Serve or an engine: its sample is `stats`, its registry and
    metrics are doubles recording what it publishes."""
    r = object.__new__(EngineReplica)
    r.last_stats = r._pushed = None
    r.gauges, r.pushed = {}, []

    async def sample() -> ReplicaStats:
        return stats

    async def put(s: ReplicaStats) -> None:
        r.pushed.append(s)

    r.stats = sample
    r.metrics = SimpleNamespace(set=lambda name, value: r.gauges.__setitem__(name, value))
    r.registry = SimpleNamespace(put=SimpleNamespace(remote=put))
    asyncio.run(r._report())
    return r


def test_every_signal_reaches_serves_autoscaler():
    replicas = [_replica(A), _replica(B)]
    reported = [r.record_autoscaling_stats() for r in replicas]
    for r in reported:
        assert set(r) == set(SIGNAL_NAMES)
    # Serve's controller: each signal per replica, as `record_autoscaling_stats` gave it.
    ctx = SimpleNamespace(
        aggregated_metrics={n: {str(i): r[n] for i, r in enumerate(reported)} for n in reported[0]},
        total_num_requests=0,
        target_num_replicas=1,
        policy_state={},
    )
    for name, (a, b) in BY_HAND.items():
        target = min(a, b) / 2  # the pool's load wants at least 3 replicas of this target
        desired, _ = PoolLoadPolicy({name: target})(ctx)
        assert desired == math.ceil((a + b) / target - 1e-9) >= 3, name


def test_every_signal_reaches_get_stats():
    pool = SimpleNamespace(autoscaling=AutoscalingSettings(max_replicas=4, targets=EVERY))
    signals = pool_signals(pool, [A, B])
    status = PoolStatus("decode", "Decode", 2, 2, 1, 4, signals)
    proto = stats_to_proto(ClusterStats((status,), (A, B)))
    got = {s.name: (s.value, s.target_per_replica) for s in proto.pools[0].signals}
    want = {n: (pytest.approx(sum(BY_HAND[n])), t) for n, t in EVERY}
    assert got == want


def test_every_signal_reaches_its_gauge():
    r = _replica(A)
    assert r.pushed == [A]
    gauges = {f.metadata["gauge"]: f.name for f in fields(LoadSignals)}
    assert len(gauges) == len(SIGNAL_NAMES), "two signals share a gauge"
    for gauge, name in gauges.items():
        assert METRICS[gauge][0] == "gauge", gauge  # declared, so Ray exports it
        assert r.gauges[gauge] == BY_HAND[name][0], gauge


def test_a_pool_sums_its_replicas_signals():
    assert pool_load([A, B]).as_dict() == {n: a + b for n, (a, b) in BY_HAND.items()}
    assert pool_load([]) == LoadSignals()


def test_a_signal_nobody_reports_is_an_error_not_a_zero():
    with pytest.raises(KeyError, match="queued_tokens"):
        LoadSignals.of(A).value("queued_tokens")
    # A target that got past config validation but names no reported signal (built around the
    # settings' own check) fails `GetStats` loudly instead of showing 0.
    bad = AutoscalingSettings()
    object.__setattr__(bad, "targets", (("queued_tokens", 1.0),))
    with pytest.raises(KeyError, match="queued_tokens"):
        pool_signals(SimpleNamespace(autoscaling=bad), [A])


def test_serves_own_request_count_is_left_to_serve_not_shown_as_zero():
    router = SimpleNamespace(autoscaling=AutoscalingSettings(targets=(("requests", 256.0),)))
    assert pool_signals(router, []) == ()
    ctx = SimpleNamespace(
        aggregated_metrics={}, total_num_requests=600, target_num_replicas=1, policy_state={}
    )
    assert PoolLoadPolicy({"requests": 256.0})(ctx)[0] == 3
