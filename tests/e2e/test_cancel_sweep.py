"""A client may cancel at any point of a request's life; every KV block comes back at once.

Each round sends ROUND concurrent ~700-token prompts to the "pd" app and cancels each of them
the same delay after it was sent. The delays sweep the life of a request: before its prefill
starts, while it prefills, around the prefill -> decode hand-off (the lease granted, the result
on its way to a router whose call is gone), while its KV moves and while it decodes. They are
placed from a calibration round on the same app, so they hit the same phases on a slow or a
fast machine. The hand-off window itself (the lease granted, the KV not yet fetched) is a few
ms wide and falls anywhere in a round's spread of prefill ends, so a fixed delay may miss it;
the sweep ends with rounds whose calls are each cancelled the moment their first token arrives
(the router has the prefill result and is calling the decode pool), repeated while no round
has landed a cancel in the window, and asserts one did: a lease ended "cancelled" on a
prefill replica, which nothing but a cancel between the grant and the fetch ends.
`FREED_WITHIN_S` after each round, every replica must report zero used, zero leased and zero
running, and over the whole sweep no lease may have expired: the lease period is the last
resort for a lost message, never how a cancel is cleaned up, and none is ended as "aborted"
(a cancel is not a failed decode hop).

Timestamps come from the replicas' own reports (`ReplicaStats.updated_at`, read from the stats
registry `GetStats` lists), so "one second after" is the replicas' clock, not the time a poll
happened to run.
"""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.serving.pool_messages import ReplicaStats
from cluster.serving.replica import REPORT_INTERVAL_S
from tests.e2e.conftest import PD, PD_LEASE_SECONDS
from tests.e2e.grpc_calls import greedy_sampling
from tests.ray_fixtures import app_metadata, stub

ROUND = 10
PROMPT_TOKENS = 700  # a few 512-token prefill steps per replica for a round, on 2 CPU cores
MAX_TOKENS = 100  # the decode still runs at the last delay
VOCAB = 4096  # the `tiny` preset's
# Well under the lease period (PD_LEASE_SECONDS), so a lease expiry can never be what freed a
# round's blocks. 1 s held alone but failed twice in full-suite runs of this session (a
# prefill still running 1 s after its cancel, with the other session apps loading 2 cores).
FREED_WITHIN_S = 2.5
# Rounds cancelled at the first token: at least one, more while none landed in the hand-off
# window, within a bound and a time budget (one such round usually lands several calls there).
HANDOFF_ROUNDS = 4
HANDOFF_BUDGET_S = 25.0
FIRST_TOKEN = "first token"  # a round's delay: each call cancelled as its first token arrives


@dataclass
class _Call:
    call: grpc.Future
    sent: float
    cancel_at_first: bool = False
    arrivals: list[float] = field(default_factory=list)
    code: grpc.StatusCode | None = None

    def read(self) -> None:
        try:
            for _ in self.call:
                self.arrivals.append(time.monotonic() - self.sent)
                if self.cancel_at_first:
                    self.call.cancel()
        except grpc.RpcError as e:
            self.code = e.code()


def test_cancelling_anywhere_in_a_requests_life_frees_its_blocks_at_once(apps):
    replicas = _reports_after(time.time(), {"prefill", "decode"})
    before = _leases_ended(replicas)
    s = stub(apps)  # one channel: the first round pays for the connection, not a delay
    calibration = _round(s, 0, None, max_tokens=2)
    first = sorted(c.arrivals[0] for c in calibration)  # the prefill's token reached the client
    decoded = max(c.arrivals[1] for c in calibration)  # the first decode token did
    delays = [
        0.0,  # before the prefill starts
        first[0] / 2,  # prefilling
        first[0] * 0.9,  # the first prefills end, their results on the way back
        first[0],
        (first[0] + first[-1]) / 2,
        first[-1],  # the last results land; KV transfers start
        (first[-1] + decoded) / 2,  # transferring
        decoded + 0.2,  # decoding
    ]
    print("cancel delays (s):", " ".join(f"{d:.3f}" for d in delays))
    seen = {0: 0, 1: 0, 2: 0}  # cancelled calls by messages received (0, 1, 2 or more)

    def sweep(n: int, delay: float | str) -> int:
        """Round `n`, cancelled at `delay`; its blocks freed in time. Returns how many
        leases have ended "cancelled" (the hand-off window hit) since the sweep began."""
        calls = _round(s, n, delay, MAX_TOKENS)
        round_end = time.time()
        for c in calls:
            seen[min(len(c.arrivals), 2)] += c.code == grpc.StatusCode.CANCELLED
        late = _reports_after(round_end + FREED_WITHIN_S, _pools(replicas))
        held = [r for r in late if _holds(r)]
        assert not held, f"{FREED_WITHIN_S}s after a round cancelled at {delay}s: {held}"
        return _leases_ended(late)["cancelled"] - before["cancelled"]

    for n, delay in enumerate(delays, start=1):
        handoffs = sweep(n, delay)
    print("hand-offs cancelled by the fixed delays:", handoffs)
    deadline = time.monotonic() + HANDOFF_BUDGET_S
    for rounds in range(1, HANDOFF_ROUNDS + 1):
        handoffs = sweep(len(delays) + rounds, FIRST_TOKEN)
        if handoffs or time.monotonic() > deadline:
            break
    print(f"hand-offs cancelled after {rounds} first-token rounds:", handoffs)
    # The sweep reached both ends: cancels before the first token and while decoding; and
    # the hand-off between them.
    print("cancelled calls by messages received (0, 1, 2+):", seen)
    assert seen[0] and seen[1] and seen[2], (seen, delays)
    assert handoffs, f"no cancel landed in the hand-off window in {rounds} first-token rounds"
    # A lease left behind would expire within lease_seconds (plus one expiry tick).
    settled = _reports_after(time.time() + PD_LEASE_SECONDS + 1.5, _pools(replicas))
    ended = _leases_ended(settled)
    print("leases ended in the sweep, by reason:", {k: n - before[k] for k, n in ended.items()})
    assert ended["expired"] == before["expired"]
    # No cancel is taken for a failed decode hop, and some lease was granted and fetched.
    assert ended["aborted"] == before["aborted"], (ended, before)
    assert ended["fetched"] > before["fetched"]
    assert not [r for r in settled if _holds(r)]
    # Operators see the same counts in the Prometheus export.
    assert _exported_lease_ends(apps.metrics_port, ended) == ended


def _round(s, n: int, delay: float | str | None, max_tokens: int) -> list[_Call]:
    """ROUND concurrent requests on stub `s` with distinct prompts (no prefix cache hit
    shortens a prefill), each cancelled `delay` seconds after it was sent (FIRST_TOKEN: as
    its first token arrives; None: read to the end)."""
    calls = []
    for i in range(ROUND):
        rng = random.Random(f"{n}-{i}")
        request = pb.GenerateRequest(
            prompt_token_ids=[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)],
            sampling=greedy_sampling(max_tokens),
        )
        sent = time.monotonic()
        call = s.Generate(request, metadata=app_metadata(PD))
        calls.append(_Call(call, sent, cancel_at_first=delay == FIRST_TOKEN))
    readers = [threading.Thread(target=c.read) for c in calls]
    for t in readers:
        t.start()
    if isinstance(delay, float):
        for c in calls:
            time.sleep(max(0.0, c.sent + delay - time.monotonic()))
            c.call.cancel()
    for t in readers:
        t.join(timeout=60)
    if delay is None:
        failed = [(c.code, c.call.details()) for c in calls if c.code is not None]
        assert not failed and all(len(c.arrivals) == max_tokens for c in calls), failed
    return calls


def _reports_after(at: float, pools: set[str]) -> list[ReplicaStats]:
    """Each engine replica's first stats report stamped at or after `at` (wall clock)."""
    import ray

    from cluster.serving.stats_registry import registry

    reg = registry(PD)
    first: dict[str, ReplicaStats] = {}
    deadline = time.monotonic() + max(0.0, at - time.time()) + 5 * REPORT_INTERVAL_S
    while True:
        listed = [r for r in ray.get(reg.list.remote()) if r.pool in pools]
        for r in listed:
            if r.updated_at >= at:
                first.setdefault(r.replica_id, r)
        if listed and {r.replica_id for r in listed} <= first.keys():
            return list(first.values())
        assert time.monotonic() < deadline, f"no stats report after {at}: {listed}"
        time.sleep(0.05)


def _pools(replicas: list[ReplicaStats]) -> set[str]:
    return {r.pool for r in replicas}


def _holds(r: ReplicaStats) -> bool:
    return bool(r.kv_blocks_used or r.kv_blocks_leased or r.running or r.waiting)


def _leases_ended(replicas: list[ReplicaStats]) -> dict[str, int]:
    """Leases ended so far on the prefill replicas, by reason."""
    ended = {"fetched": 0, "cancelled": 0, "aborted": 0, "expired": 0}
    for r in replicas:
        for reason, n in r.kv_leases_ended.items():
            ended[reason] += n
    return ended


def _exported_lease_ends(metrics_port: int, want: dict[str, int]) -> dict[str, int]:
    """The app's leases ended by reason as the Prometheus export has them
    (`pdserve_kv_leases_released_total{reason}`, `pdserve_kv_leases_expired_total`), polled
    until they equal `want` or 30 s pass (Ray exports every few seconds)."""
    deadline = time.monotonic() + 30.0
    while True:
        got = dict.fromkeys(want, 0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                if s.labels.get("application") != PD:
                    continue
                if s.name == "ray_pdserve_kv_leases_released_total":
                    got[s.labels["reason"]] += int(s.value)
                elif s.name == "ray_pdserve_kv_leases_expired_total":
                    got["expired"] += int(s.value)
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(1.0)
