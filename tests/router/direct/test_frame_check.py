"""The limits the direct endpoint keeps from a client's frame headers, before h2 sees the bytes
(router/direct/frame_check.py), on a connection over an in-memory transport: a frame that claims
more than SETTINGS_MAX_FRAME_SIZE is refused with GOAWAY FRAME_SIZE_ERROR with none of it
buffered, one of exactly that size is taken, and a first frame after the preface that is not
SETTINGS is refused with GOAWAY PROTOCOL_ERROR, no stream served; a header block whose
CONTINUATION frames claim more than the header list's limit is GOAWAY ENHANCE_YOUR_CALM before
h2 holds it; the check gives the same
verdict wherever the reads cut the bytes. And what the client closes (a stream it resets, the
connection its GOAWAY ends) in the read that a refusal answers takes nothing else down."""

from __future__ import annotations

import asyncio

from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame, HeadersFrame

from router.direct import DirectLimits, service_methods
from router.direct.frame_check import FrameCheck
from router.direct.grpc_connection import GrpcConnection
from router.direct.limits import MAX_FRAME_BYTES
from router.router import GENERATION
from tests.router.direct.corpus.make_corpus import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    GOAWAY,
    HEADERS,
    HELLO,
    PING,
    RST,
    call,
    headers,
    raw,
    settings,
    window,
)
from tests.router.direct.h2_client import grpc_headers
from tests.router.direct.rig import Servicer
from tests.router.direct.test_frame_fuzz import server_frames
from tests.router.direct.wire import PREFACE, MemoryTransport
from tests.router.fake_service import FakeService


def serve(
    reads: list[bytes], fake: FakeService | None = None
) -> tuple[GrpcConnection, MemoryTransport, int]:
    """A connection fed `reads`, its calls run after each; it, its transport and the bytes h2
    was given. No task is left, and none failed."""

    async def go():
        methods = service_methods(GENERATION, Servicer(fake or FakeService()))
        conn = GrpcConnection(methods, set(), DirectLimits())
        given = 0
        receive = conn.h2.receive_data

        def counted(data):
            nonlocal given
            given += len(data)
            return receive(data)

        conn.h2.receive_data = counted
        transport = MemoryTransport()
        transport.protocol = conn
        conn.connection_made(transport)
        for data in reads:
            conn.data_received(data)  # raises nothing
            for _ in range(20):
                await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}
        return conn, transport, given

    return asyncio.run(go())


def goaway(transport: MemoryTransport) -> GoAwayFrame | None:
    frames = server_frames(bytes(transport.out))
    return next((f for f in frames if isinstance(f, GoAwayFrame)), None)


def test_a_frame_claimed_past_the_max_frame_size_is_refused_before_it_is_buffered():
    head = raw(DATA, 0, 1, length=MAX_FRAME_BYTES + 1)
    before = HELLO + headers(1)
    conn, transport, given = serve([before + head, b"x" * MAX_FRAME_BYTES])
    assert conn.h2.max_inbound_frame_size == MAX_FRAME_BYTES  # what the endpoint advertises
    assert goaway(transport).error_code == ErrorCodes.FRAME_SIZE_ERROR
    assert goaway(transport).last_stream_id == 1  # the frames before it were taken
    assert given == len(before) and transport.closing  # not a byte of it buffered


def test_a_frame_of_the_max_frame_size_is_taken():
    conn, transport, _ = serve([HELLO + headers(1) + raw(DATA, 0, 1, bytes(MAX_FRAME_BYTES))])
    assert goaway(transport) is None and not transport.closing
    assert list(conn.calls) == [1]  # its request not yet whole


def test_a_first_frame_other_than_settings_is_refused_and_no_stream_served():
    conn, transport, given = serve([PREFACE + call(1) + settings()])
    assert goaway(transport).error_code == ErrorCodes.PROTOCOL_ERROR
    assert given == len(PREFACE) and transport.closing
    assert not any(isinstance(f, HeadersFrame) for f in server_frames(bytes(transport.out)))


def test_a_header_block_past_the_header_list_limit_is_refused_before_h2_holds_it():
    limit = DirectLimits().header_block_bytes
    start = headers(1, flags=0)  # no END_HEADERS: CONTINUATION frames must follow
    more = [raw(CONTINUATION, 0, 1, bytes(4096)) for _ in range(limit // 4096 + 1)]
    conn, transport, given = serve([HELLO + start + b"".join(more)])
    assert goaway(transport).error_code == ErrorCodes.ENHANCE_YOUR_CALM and transport.closing
    assert given == len(HELLO + start) + (limit // 4096) * (9 + 4096)  # the last one not held
    assert not conn.calls


def test_header_blocks_within_the_limit_are_counted_each_on_its_own():
    """Many blocks on one connection, each ended by END_HEADERS: none adds to the next."""
    check, limit = FrameCheck(), DirectLimits().header_block_bytes
    one = raw(HEADERS, 0, 1, bytes(limit - 10)) + raw(CONTINUATION, END_HEADERS, 1, bytes(10))
    assert check.check(HELLO + one * 50, MAX_FRAME_BYTES, limit) is None
    over = raw(HEADERS, 0, 3, bytes(limit)) + raw(CONTINUATION, END_HEADERS, 3, bytes(1))
    assert check.check(over, MAX_FRAME_BYTES, limit) == (9 + limit, ErrorCodes.ENHANCE_YOUR_CALM)


def test_the_check_gives_the_same_verdict_wherever_two_reads_cut_the_bytes():
    """At a max frame size of 64 and header blocks of 100: the failing header's offset in the
    read that completes it (0 if it began in the read before)."""
    good = HELLO + raw(PING, 0, 0, bytes(8)) + raw(DATA, 0, 1, bytes(64)) + raw(0xFA, 0, 0)
    block = raw(HEADERS, 0, 5, bytes(60)) + raw(CONTINUATION, 0, 5, bytes(40))
    cases = [
        (good, None),
        (good + raw(HEADERS, 0, 3, length=65) + b"xx", (len(good), ErrorCodes.FRAME_SIZE_ERROR)),
        (PREFACE + raw(PING, 0, 0, bytes(8)) + HELLO, (len(PREFACE), ErrorCodes.PROTOCOL_ERROR)),
        (good + block, None),
        (
            good + block + raw(CONTINUATION, 4, 5, b"x"),
            (len(good + block), ErrorCodes.ENHANCE_YOUR_CALM),
        ),
    ]
    for stream, want in cases:
        for cut in range(len(stream) + 1):
            check = FrameCheck()
            first = check.check(stream[:cut], 64, 100)
            second = None if first else check.check(stream[cut:], 64, 100)
            if want is None:
                assert first is None and second is None, cut
            elif want[0] + 9 <= cut:  # the header whole in the first read
                assert first == want, cut
            else:
                assert first is None and second == (max(want[0] - cut, 0), want[1]), cut


def test_a_refusal_of_a_stream_reset_in_the_same_read_takes_nothing_else_down():
    """A 405 due to stream 1, reset in the read that carries its headers: dropped; stream 3's
    call, in the same read, is answered."""
    get = [(b":method", b"GET"), *grpc_headers()[1:]]
    conn, transport, _ = serve([HELLO + headers(1, get) + raw(RST, 0, 1, bytes(4)) + call(3)])
    ends = [f.stream_id for f in server_frames(bytes(transport.out)) if "END_STREAM" in f.flags]
    assert ends == [3] and not transport.closing


def test_answers_on_a_connection_the_clients_goaway_ended_are_dropped():
    """A refusal and a call read with the client's GOAWAY: nothing answered, no call run."""
    get = [(b":method", b"GET"), *grpc_headers()[1:]]
    goaway_frame = raw(GOAWAY, 0, 0, bytes(8))
    conn, transport, _ = serve([HELLO + headers(1, get) + call(3) + goaway_frame])
    assert not any(isinstance(f, HeadersFrame) for f in server_frames(bytes(transport.out)))
    assert transport.closing and not conn.calls


def test_a_window_read_with_the_clients_goaway_sends_nothing_and_ends_the_call():
    """A response held back by a 4-byte window; the window grows in the read that carries the
    client's GOAWAY: nothing more is sent, and the call ends, its generation closed."""
    fake = FakeService()
    held = PREFACE + settings((4, 4)) + call(1)
    conn, transport, _ = serve(
        [held, window(1, 100) + window(0, 100) + raw(GOAWAY, 0, 0, bytes(8))], fake
    )
    assert transport.closing and not conn.calls and not conn.waiting
    assert fake.opened == fake.closed == 1
