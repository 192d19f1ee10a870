"""Property tests of the direct endpoint's decoding path (h2's framing and HPACK under
`GrpcConnection`): arbitrary bytes, and arbitrary sequences of well-formed and broken frames,
fed to a connection over an in-memory transport. Whatever arrives, `data_received` never
raises; a connection the input breaks is refused with GOAWAY and closed; and once it is gone
nothing of it is left: no call, no task, no timer, no place among the server's connections.
Derandomized (a fixed sequence of examples), so CI sees the same inputs every run."""

from __future__ import annotations

import asyncio

from hpack import Encoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    PriorityFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.direct import DirectLimits, service_methods
from router.direct.grpc_connection import GrpcConnection
from router.router import GENERATION
from tests.router.direct.h2_client import frame, grpc_headers
from tests.router.direct.rig import Servicer, request
from tests.router.direct.wire import PREFACE, MemoryTransport
from tests.router.fake_service import FakeService

FUZZ = settings(
    max_examples=100,
    database=None,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
LIMITS = DirectLimits(
    max_streams=8,
    max_header_list_bytes=1024,
    max_request_bytes=4096,
    stream_window_bytes=8192,
    connection_window_bytes=65535,
)


def server_frames(out: bytes) -> list[Frame]:
    frames, at = [], 0
    while at + 9 <= len(out):
        f, length = Frame.parse_frame_header(memoryview(out[at : at + 9]))
        f.parse_body(memoryview(out[at + 9 : at + 9 + length]))
        frames.append(f)
        at += 9 + length
    return frames


async def feed(chunks: list[bytes]) -> tuple[GrpcConnection, MemoryTransport, set]:
    connections: set = set()
    methods = service_methods(GENERATION, Servicer(FakeService()))
    conn = GrpcConnection(methods, connections, LIMITS)
    transport = MemoryTransport()
    transport.protocol = conn
    conn.connection_made(transport)
    for chunk in chunks:
        conn.data_received(chunk)  # raises nothing, whatever the bytes
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)  # calls run
    broken = transport.closing
    if not broken:
        transport.close()  # the client goes: everything of the connection must go too
    for _ in range(50):
        await asyncio.sleep(0)
    return conn, transport, connections, broken


def check(chunks: list[bytes]) -> None:
    async def go():
        conn, transport, connections, broken = await feed(chunks)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.wait_for(asyncio.gather(*others, return_exceptions=True), 5)
        return conn, transport, connections, broken

    conn, transport, connections, broken = asyncio.run(go())
    frames = server_frames(bytes(transport.out))
    if broken:
        assert any(isinstance(f, GoAwayFrame) for f in frames), frames
    assert not conn.calls and not conn.waiting
    assert conn not in connections
    assert conn.guard.timer is None


@FUZZ
@given(st.lists(st.binary(max_size=300), max_size=6), st.booleans())
def test_arbitrary_bytes_are_refused_with_goaway_and_leave_nothing(chunks, preface):
    check(([PREFACE + SettingsFrame(0).serialize()] if preface else []) + chunks)


stream_ids = st.sampled_from([0, 1, 2, 3, 5, 7, 9, 2**31 - 1])
payloads = st.binary(max_size=64)


def header_block(draw) -> bytes:
    kind = draw(st.sampled_from(["grpc", "random", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "grpc":
        fields = grpc_headers()
    else:
        text = st.binary(min_size=0, max_size=40)
        fields = draw(st.lists(st.tuples(text, text), max_size=8))
    return Encoder().encode(fields)


@st.composite
def frames(draw) -> bytes:
    """One frame of any type, its fields drawn, addressed to any stream (also one its type
    forbids: hyperframe refuses to build those, so the id is written into its header after);
    or 9 random header bytes and a random payload."""
    kind = draw(st.sampled_from(list(BUILDERS) + ["raw"]))
    if kind == "raw":
        return draw(st.binary(min_size=9, max_size=9)) + draw(payloads)
    f = BUILDERS[kind](draw, draw(st.booleans()))
    raw = bytearray(f.serialize())
    raw[5:9] = draw(stream_ids).to_bytes(4, "big")
    return bytes(raw)


def _headers(draw, end: bool) -> Frame:
    f = HeadersFrame(1, flags=["END_HEADERS"] * draw(st.booleans()) + ["END_STREAM"] * end)
    f.data = header_block(draw)
    return f


def _data(draw, end: bool) -> Frame:
    body = draw(st.sampled_from([frame(request(2).SerializeToString()), b""])) or draw(payloads)
    return DataFrame(1, body, flags=["END_STREAM"] * end)


def _continuation(draw, end: bool) -> Frame:
    f = ContinuationFrame(1, flags=["END_HEADERS"] * end)
    f.data = header_block(draw)
    return f


def _settings(draw, end: bool) -> Frame:
    values = draw(st.dictionaries(st.integers(1, 8), st.integers(0, 2**32 - 1), max_size=3))
    return SettingsFrame(0, settings={} if end else values, flags=["ACK"] * end)


BUILDERS = {
    "headers": _headers,
    "data": _data,
    "continuation": _continuation,
    "settings": _settings,
    "ping": lambda draw, end: PingFrame(
        0, opaque_data=draw(st.binary(min_size=8, max_size=8)), flags=["ACK"] * end
    ),
    "window": lambda draw, end: WindowUpdateFrame(
        0, window_increment=draw(st.integers(0, 2**31 - 1))
    ),
    "rst": lambda draw, end: RstStreamFrame(1, error_code=draw(st.integers(0, 20))),
    "priority": lambda draw, end: PriorityFrame(1, depends_on=draw(stream_ids)),
    "goaway": lambda draw, end: GoAwayFrame(
        0, last_stream_id=draw(stream_ids), error_code=draw(st.integers(0, 20))
    ),
}


@FUZZ
@given(st.lists(frames(), max_size=12))
def test_arbitrary_frame_sequences_are_refused_with_goaway_and_leave_nothing(sequence):
    check([PREFACE + SettingsFrame(0).serialize(), *sequence])
