"""The two attacks of issue 37's acceptance, each from a client process of its own
(attacker.py) against an endpoint in this process, whose memory is measured (tracemalloc's
peak over the attack, from a baseline taken with the endpoint up) against what
`DirectLimits.memory_bound_bytes` states for the connections the attack opens: 1,000 streams
whose requests never end, over 10 connections, and a flood of PINGs its sender never reads
the answers to. Each client must be cut off (its streams refused, its connections closed),
and every generation the servicer opened closed. A third test measures what one stream with
the costliest header list holds against what the bound counts for it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tracemalloc

from h2.errors import ErrorCodes
from hpack import Encoder
from hyperframe.frame import ContinuationFrame, HeadersFrame, SettingsFrame

from router.direct import DirectLimits, service_methods
from router.direct.grpc_connection import GrpcConnection
from router.direct.limits import HEADER_OBJECT_FACTOR, STREAM_STATE_BYTES
from router.router import GENERATION
from tests.router.direct.h2_client import grpc_headers
from tests.router.direct.rig import Servicer, serving, until
from tests.router.direct.wire import PREFACE, MemoryTransport
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


def header_lists(limits: DirectLimits, streams: int) -> list[bytes]:
    """HEADERS (and CONTINUATION) frames for `streams` requests whose header lists fill
    `max_header_list_bytes` with the costliest shape: as many tiny fields as fit."""
    encoder = Encoder()
    fields = grpc_headers()
    room = limits.max_header_list_bytes - sum(32 + len(k) + len(v) for k, v in fields) - 64
    for i in range(room // 37):
        fields.append((f"{i:04x}".encode(), b"v"))  # 37 bytes as HPACK counts them
    blocks = []
    for n in range(streams):
        block = encoder.encode(fields)
        pieces = [block[i : i + 16384] for i in range(0, len(block), 16384)]
        last = len(pieces) - 1
        frames = [
            (HeadersFrame if i == 0 else ContinuationFrame)(
                2 * n + 1, piece, flags=["END_HEADERS"] if i == last else []
            ).serialize()
            for i, piece in enumerate(pieces)
        ]
        blocks.append(b"".join(frames))
    return blocks


def test_a_streams_cost_is_within_what_the_bound_counts_for_it():
    """`max_streams` streams, each with a full header list of tiny fields and no body: what
    each holds (traced) is within `STREAM_STATE_BYTES + HEADER_OBJECT_FACTOR x` the list."""
    limits = DirectLimits(max_streams=200)
    blocks = header_lists(limits, limits.max_streams)

    async def go():
        methods = service_methods(GENERATION, Servicer(FakeService()))
        conn = GrpcConnection(methods, set(), limits)
        transport = MemoryTransport()
        transport.protocol = conn
        conn.connection_made(transport)
        conn.data_received(PREFACE + SettingsFrame(0).serialize())
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            for block in blocks:
                conn.data_received(block)
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        opened = len(conn.calls)
        transport.close()
        await asyncio.sleep(0.01)
        return (held - base) / opened, opened

    per_stream, opened = asyncio.run(go())
    counted = STREAM_STATE_BYTES + HEADER_OBJECT_FACTOR * limits.max_header_list_bytes
    print(
        f"\none stream with a full header list: {per_stream / 1024:.1f} KiB, "
        f"counted {counted / 1024:.0f} KiB"
    )
    assert opened == limits.max_streams
    assert per_stream <= counted
