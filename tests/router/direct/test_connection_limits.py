"""`DirectLimits` one by one, each with a hostile raw HTTP/2 client (wire.py) on loopback, at
small values so each acts within a second: connections, the handshake, idleness, a request
that never arrives whole, flow control of request bytes (per stream and per connection),
PING strikes, a client that does not read, the header list before SETTINGS are acknowledged,
and the router's admission. Every test ends with each generation the servicer opened closed."""

from __future__ import annotations

import asyncio
import socket
import time

from h2.errors import ErrorCodes
from hyperframe.frame import HeadersFrame, RstStreamFrame, SettingsFrame, WindowUpdateFrame

from router.direct import Admission, DirectLimits, GrpcServer, service_methods
from router.router import GENERATION
from tests.router.direct.h2_client import Answer, RawClient, frame, grpc_headers
from tests.router.direct.rig import Servicer, all_closed, request, serving, until
from tests.router.direct.wire import Wire, data, goaway, ping
from tests.router.fake_service import FakeService

BODY = frame(request(2).SerializeToString())
INFO = grpc_headers(b"/pdserve.v1.Generation/GetModelInfo")


def test_connections_past_the_limit_are_sent_goaway_and_closed():
    async def go():
        async with serving(FakeService(), DirectLimits(max_connections=2)) as endpoint:
            first, second = [await RawClient.connect(endpoint) for _ in range(2)]
            served = [await c.call(INFO, frame(b"")) for c in (first, second)]
            third = await Wire.connect(endpoint)
            refused = await third.until_closed()
            await first.close()
            await asyncio.sleep(0.05)
            fourth = await RawClient.connect(endpoint)  # a place is free again
            again = await fourth.call(INFO, frame(b""))
            for c in (second, fourth):
                await c.close()
        return served, refused, again

    served, refused, again = asyncio.run(go())
    assert all(a.status[b"grpc-status"] == b"0" for a in [*served, again])
    assert goaway(refused).error_code == ErrorCodes.ENHANCE_YOUR_CALM


def test_a_client_without_preface_is_closed_at_the_handshake_timeout():
    limits = DirectLimits(handshake_timeout_s=0.3, idle_timeout_s=60)

    async def go():
        async with serving(FakeService(), limits) as endpoint:
            silent = await Wire.connect(endpoint, handshake=False)
            polite = await Wire.connect(endpoint)
            start = time.monotonic()
            frames = await silent.until_closed(timeout_s=3)
            closed_after = time.monotonic() - start
            await asyncio.sleep(0.3)
            polite.send(ping(1))  # past the timeout, the one that spoke is still served
            answer = await polite.frame()
            for w in (silent, polite):
                await w.close()
        return frames, closed_after, answer

    frames, closed_after, answer = asyncio.run(go())
    assert 0.25 < closed_after < 1.5
    assert goaway(frames) is None  # nothing but the server's own SETTINGS
    assert answer is not None


def test_a_connection_without_streams_is_closed_at_the_idle_timeout():
    limits = DirectLimits(idle_timeout_s=0.4)

    async def go():
        fake = FakeService()
        fake.hang_after_first = True
        async with serving(fake, limits) as endpoint:
            busy = await RawClient.connect(endpoint)
            hanging = await busy.send(grpc_headers(), BODY)
            await until(lambda: fake.opened == 1)
            idle = await Wire.connect(endpoint)
            start = time.monotonic()
            frames = await idle.until_closed(timeout_s=3)
            idle_after = time.monotonic() - start
            busy.h2.reset_stream(hanging)  # a stream held open kept `busy` going meanwhile
            busy.writer.write(busy.h2.data_to_send())
            await until(all_closed(fake))
            rest = await Wire(busy.reader, busy.writer).until_closed(timeout_s=3)
            await idle.close()
        return frames, idle_after, rest, fake

    frames, idle_after, rest, fake = asyncio.run(go())
    assert 0.35 < idle_after < 1.5
    assert goaway(frames).error_code == ErrorCodes.NO_ERROR
    assert goaway(rest).error_code == ErrorCodes.NO_ERROR
    assert fake.opened == fake.closed == 1


def test_a_request_that_never_arrives_whole_is_refused_and_its_window_returned():
    limits = DirectLimits(receive_timeout_s=0.3)

    async def go():
        fake = FakeService()
        async with serving(fake, limits) as endpoint:
            client = await RawClient.connect(endpoint)
            stream = client.h2.get_next_available_stream_id()
            client.h2.send_headers(stream, grpc_headers())
            client.h2.send_data(stream, BODY[:3])  # and never the rest
            client.writer.write(client.h2.data_to_send())
            client.answers[stream] = Answer()
            start = time.monotonic()
            refused = await client.answer(stream)
            refused_after = time.monotonic() - start
            served = await client.call(grpc_headers(), BODY)  # the connection goes on
            await client.close()
        return refused, refused_after, served, fake

    refused, refused_after, served, fake = asyncio.run(go())
    assert refused.status[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED
    assert 0.25 < refused_after < 1.5
    assert served.trailers[b"grpc-status"] == b"0"
    assert fake.opened == fake.closed == 1


def test_request_bytes_are_acknowledged_only_as_calls_read_them():
    """Bodies that never end: each stream is fed its window and no more, the connection its
    window (65,535 here) and no more: no WINDOW_UPDATE comes while nothing is read. A reset
    stream's bytes are given back; a finished request's too, once its call read it; a byte
    past a window is a flow-control error that ends the connection."""
    limits = DirectLimits(
        max_request_bytes=20_000, stream_window_bytes=20_005, connection_window_bytes=65_535
    )
    head = b"\0" + (20_000).to_bytes(4, "big")  # a message that would be 20,000 bytes

    async def go():
        fake = FakeService()
        async with serving(fake, limits) as endpoint:
            wire = await Wire.connect(endpoint)
            for stream in (1, 3, 5):  # 3 x 20,005 bytes: each stream's whole window
                wire.headers(stream, grpc_headers())
                wire.send(data(stream, head + b"\0" * 20_000))
            wire.headers(7, grpc_headers())
            wire.send(data(7, head + b"\0" * 5_515))  # the rest of the connection's window
            held = await wire.for_a_while(0.5)
            wire.send(RstStreamFrame(1, error_code=8).serialize())  # CANCEL
            updates = []
            while not updates:
                f = await wire.frame()
                if isinstance(f, WindowUpdateFrame):
                    updates.append((f.stream_id, f.window_increment))
            wire.headers(9, grpc_headers())
            wire.send(data(9, BODY, end_stream=True))  # fits in what came back: served
            answered = []
            while len(answered) < 2:
                f = await wire.frame()
                if isinstance(f, HeadersFrame) and f.stream_id == 9:
                    answered.append(f)
            wire.send(data(3, b"\0"))  # past stream 3's window
            end = await wire.until_closed()
            await wire.close()
            await until(all_closed(fake))
        return held, updates, end, fake

    held, updates, end, fake = asyncio.run(go())
    assert [type(f) for f in held] == [SettingsFrame, SettingsFrame]  # theirs and our ack
    assert updates == [(0, 20_005)]
    assert goaway(end).error_code == ErrorCodes.FLOW_CONTROL_ERROR
    assert fake.opened == fake.closed == 1


def test_pings_past_the_strikes_get_goaway_enhance_your_calm():
    limits = DirectLimits(min_ping_interval_s=0.2, max_ping_strikes=2)

    async def go():
        async with serving(FakeService(), limits) as endpoint:
            spaced = await Wire.connect(endpoint)
            for n in range(4):  # one every interval: no strike
                spaced.send(ping(n))
                await asyncio.sleep(0.25)
            cleared = await RawClient.connect(endpoint)
            cleared.writer.write(cleared.h2.data_to_send())  # its preface
            for _ in range(4):  # two strikes, cleared by each answer's HEADERS and DATA
                for n in range(2):
                    cleared.writer.write(ping(n))
                await cleared.call(INFO, frame(b""))
            flood = await Wire.connect(endpoint)
            for n in range(4):  # the first is free, then three strikes
                flood.send(ping(n))
            frames = await flood.until_closed()
            spaced.send(ping(9))
            alive = await spaced.frame()
            for c in (spaced, cleared, flood):
                await c.close()
        return frames, alive

    frames, alive = asyncio.run(go())
    calm = goaway(frames)
    assert calm.error_code == ErrorCodes.ENHANCE_YOUR_CALM
    assert calm.additional_data == b"too_many_pings"
    assert alive is not None


def test_a_client_that_reads_nothing_is_dropped_at_the_write_bound():
    """PING acks piling up for a client that reads nothing (strikes off): dropped once more
    than `write_buffer_bytes` wait beyond the sockets' buffers (both made small here)."""
    limits = DirectLimits(write_buffer_bytes=64 << 10, max_ping_strikes=1 << 30)

    async def go():
        server = GrpcServer("127.0.0.1", limits=limits)
        await server.start(service_methods(GENERATION, Servicer(FakeService())))
        try:
            host, port = server.endpoint.rsplit(":", 1)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=sock)
            await until(lambda: server._connections)
            for conn in server._connections:
                conn.transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_SNDBUF, 4096
                )
            writer.write(PREFACE_AND_SETTINGS)
            flood = b"".join(ping(n) for n in range(10_000))  # 170 KB of acks to send back
            rounds = 0
            try:
                while rounds < 20:
                    rounds += 1
                    writer.write(flood)
                    await asyncio.wait_for(writer.drain(), 2.0)
                    await asyncio.sleep(0.05)
            except ConnectionError:
                pass
            await until(lambda: not server._connections)
            writer.close()
        finally:
            await server.stop(1.0)
        return rounds

    assert asyncio.run(go()) < 20


PREFACE_AND_SETTINGS = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize()


def test_a_header_list_over_the_limit_closes_before_settings_are_acknowledged():
    """Headers past `max_header_list_bytes` in the client's very first flight, before it has
    read (so acknowledged) the SETTINGS that announce the limit: the connection is closed and
    no call is made."""
    limits = DirectLimits(max_header_list_bytes=1024)

    async def go():
        fake = FakeService()
        async with serving(fake, limits) as endpoint:
            wire = await Wire.connect(endpoint)  # and never an ack of the server's SETTINGS
            wire.headers(1, grpc_headers(x_padding=b"x" * 2048))
            wire.send(data(1, BODY, end_stream=True))
            frames = await wire.until_closed()
            await wire.close()
        return frames, fake

    frames, fake = asyncio.run(go())
    assert goaway(frames) is not None
    assert not any(isinstance(f, HeadersFrame) for f in frames)
    assert fake.opened == 0


class Context:
    """A proxied call's context, as far as the router's `Generate` uses it."""

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details


def test_direct_calls_take_the_routers_admission_and_queue_like_proxied_ones():
    """Limit 2, queue 1: a proxied call (the router's `Generate` with grpc's context) and a
    direct stream run, a second direct stream waits with its request unread, a third is
    refused RESOURCE_EXHAUSTED at once; the proxied call's end lets the waiting one run."""
    admission = Admission(2, 1)

    async def go():
        fake = FakeService()
        fake.hang_after_first = True
        async with serving(fake, admission=admission) as endpoint:
            proxied = Servicer(fake, admission).Generate(request(10), Context())
            await anext(proxied)
            client = await RawClient.connect(endpoint)
            running = await client.send(grpc_headers(), BODY)
            await until(lambda: fake.opened == 2)
            waiting = await client.send(grpc_headers(), BODY)
            await until(lambda: len(admission.waiting) == 1)
            refused = await client.call(grpc_headers(), BODY)
            full = (admission.ongoing, len(admission.waiting), fake.opened)
            await proxied.aclose()
            await until(lambda: fake.opened == 3)  # the waiting one runs
            for stream in (running, waiting):
                client.h2.reset_stream(stream)
            client.writer.write(client.h2.data_to_send())
            await until(all_closed(fake))
            await until(lambda: admission.ongoing == 0)
            await client.close()
        return refused, full, fake

    refused, full, fake = asyncio.run(go())
    assert refused.status[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
    assert b"limit of 2 calls" in refused.status[b"grpc-message"]
    assert full == (2, 1, 2)
    assert fake.opened == fake.closed == 3
