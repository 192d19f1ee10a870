"""The two attacks of issue 37's acceptance, each from a client process of its own
(attacker.py) against an endpoint in this process, whose memory is measured (tracemalloc's
peak over the attack, from a baseline taken with the endpoint up) against what
`DirectLimits.memory_bound_bytes` states for the connections the attack opens: 1,000 streams
whose requests never end, over 10 connections, and a flood of PINGs its sender never reads
the answers to. Each client must be cut off (its streams refused, its connections closed),
and every generation the servicer opened closed."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tracemalloc

from h2.errors import ErrorCodes

from router.direct import DirectLimits
from tests.router.direct.rig import serving, until
from tests.router.fake_service import FakeService

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


async def attack(*args: object) -> dict:
    """Run attacker.py with `args`; its JSON report."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.router.direct.attacker",
        *map(str, args),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0
    return json.loads(out)


def statm_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measured(run) -> tuple[dict, int, int]:
    """`run()` (`under_attack`) with tracemalloc on."""
    tracemalloc.start()
    try:
        return asyncio.run(run())
    finally:
        tracemalloc.stop()


async def under_attack(limits: DirectLimits, fake: FakeService, *args: object):
    """The attack's report, the traced peak above the baseline, the RSS growth."""
    async with serving(fake, limits) as endpoint:
        await asyncio.sleep(0.1)
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        rss = statm_rss_bytes()
        report = await attack(args[0], endpoint, *args[1:])
        _, peak = tracemalloc.get_traced_memory()
        grown = statm_rss_bytes() - rss
        await until(lambda: fake.opened == fake.closed)
    return report, peak - base, grown


def test_a_thousand_never_ending_streams_are_cut_off_within_the_bound():
    """10 connections x 100 streams (the stream limit), each body announced as a whole
    request and never ended: each connection is fed its 1 MiB window and no more while the
    bodies hang, the streams are refused at the receive timeout, the connections closed at
    the idle timeout."""
    limits = DirectLimits(
        max_connections=16,
        max_streams=100,
        max_request_bytes=64 << 10,
        stream_window_bytes=(64 << 10) + 5,
        connection_window_bytes=1 << 20,
        receive_timeout_s=2.0,
        idle_timeout_s=0.5,
    )
    fake = FakeService()
    report, peak, rss = measured(
        lambda: under_attack(limits, fake, "streams", 10, 100, limits.max_request_bytes)
    )
    conns = report["connections"]
    bound = limits.memory_bound_bytes(10)
    print(
        f"\n1,000 streams: traced peak {peak / 2**20:.1f} MiB, RSS +{rss / 2**20:.1f} MiB, "
        f"bound {bound / 2**20:.1f} MiB, sent {sum(c['sent'] for c in conns) / 2**20:.1f} MiB"
    )
    assert len(conns) == 10
    assert all(c["reset"] == 100 for c in conns)  # every stream refused
    assert all(c["goaway"] == ErrorCodes.NO_ERROR for c in conns)  # then closed idle
    assert peak <= bound
    assert fake.opened == 0  # no request arrived whole: no call ran


def test_a_ping_flood_is_cut_off_within_the_bound():
    """100,000 PINGs written at once, no answer read: GOAWAY ENHANCE_YOUR_CALM at the third
    strike, the connection closed; what the endpoint held for it stays within one
    connection's bound."""
    limits = DirectLimits()
    fake = FakeService()
    report, peak, rss = measured(lambda: under_attack(limits, fake, "pings", 100_000))
    bound = limits.memory_bound_bytes(1)
    print(
        f"\nPING flood: traced peak {peak / 2**20:.2f} MiB, RSS +{rss / 2**20:.1f} MiB, "
        f"bound {bound / 2**20:.1f} MiB, {report['acks']} acks read"
    )
    assert report["goaway"] == ErrorCodes.ENHANCE_YOUR_CALM
    assert report["debug"] == "too_many_pings"
    assert report["acks"] < 2_000  # cut off within a slice of the flood, not after it
    assert peak <= bound
