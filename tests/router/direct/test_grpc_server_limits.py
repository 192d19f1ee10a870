"""The limits `router.direct`'s docstring states, one test each, on loopback: a request's size,
streams per connection, a request's header list, and the response bytes held for a client that
reads slowly or not at all. Every test ends with each generation the servicer opened closed."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from h2.settings import SettingCodes

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from router.direct import DirectLimits, GrpcServer, service_methods
from router.router import GENERATION
from tests.router.direct.h2_client import RawClient, frame, grpc_headers
from tests.router.direct.rig import (
    SMALL_WINDOW,
    all_closed,
    connected,
    request,
    serving,
    until,
)
from tests.router.fake_service import FakeService

MAX_REQUEST_BYTES = DirectLimits().max_request_bytes
MAX_HEADER_LIST_BYTES = DirectLimits().max_header_list_bytes


def test_a_request_over_the_size_limit_is_refused():
    async def go():
        async with serving(FakeService()) as endpoint:
            client = await RawClient.connect(endpoint)
            big = request(2, "x" * (MAX_REQUEST_BYTES + 1)).SerializeToString()
            answer = await client.call(grpc_headers(), frame(big))
            await client.close()
        return answer

    answer = asyncio.run(go())
    assert answer.headers[b"grpc-status"] == b"8"  # RESOURCE_EXHAUSTED
    assert b"limit" in answer.headers[b"grpc-message"]


def test_a_stream_over_the_connections_limit_closes_it():
    """`max_streams` calls run at once on one connection; the next stream is a protocol error
    that closes the connection, and every generation on it is closed."""

    async def go():
        fake = FakeService()
        fake.hang_after_first = True
        async with serving(fake, DirectLimits(max_streams=8)) as endpoint:
            # no read before the 9th stream: the client has not seen the server's limit
            client = await RawClient.connect(endpoint)
            for _ in range(8):
                await client.send(grpc_headers(), frame(request(10).SerializeToString()))
            await until(lambda: fake.opened == 8)
            ninth = await client.send(grpc_headers(), frame(request(10).SerializeToString()))
            with pytest.raises(ConnectionError):
                await client.answer(ninth)
            await until(all_closed(fake))
            await client.close()
        return fake

    fake = asyncio.run(go())
    assert fake.opened == fake.closed == 8


def test_a_header_list_over_the_limit_closes_the_connection():
    """A request whose headers come to more than `max_header_list_bytes` closes the connection
    (the limit the server advertises, not h2's larger default); one just under is served."""
    under = b"x" * (MAX_HEADER_LIST_BYTES - 1024)  # the other headers fit in 1 KiB
    over = b"x" * MAX_HEADER_LIST_BYTES

    async def go():
        fake = FakeService()
        async with serving(fake) as endpoint:
            client = await RawClient.connect(endpoint)
            body = frame(request(2).SerializeToString())
            first = await client.call(grpc_headers(), body)
            served = await client.call(grpc_headers(x_padding=under), body)
            with pytest.raises(ConnectionError):
                await client.call(grpc_headers(x_padding=over), body)
            await client.close()
        return first, served, fake

    first, served, fake = asyncio.run(go())
    assert first.trailers[b"grpc-status"] == served.trailers[b"grpc-status"] == b"0"
    assert fake.opened == fake.closed == 2


def test_a_response_larger_than_the_clients_window_arrives_whole():
    """128 KiB in one message to a client with a 1 KiB window: many DATA frames, each sent as
    the client's window updates allow."""

    async def go():
        fake = FakeService()
        fake.model = replace(fake.model, model_id="m" * (128 << 10))
        async with connected(fake, SMALL_WINDOW) as (stub, _):
            return await stub.GetModelInfo(pb.GetModelInfoRequest())

    assert asyncio.run(go()).model_id == "m" * (128 << 10)


class Flood:
    """A `Generate` that yields 1 KiB messages without ever awaiting anything of its own."""

    def __init__(self, messages: int) -> None:
        self.messages = messages
        self.made = 0
        self.closed = False

    async def Generate(self, request, context):
        try:
            for _ in range(self.messages):
                self.made += 1
                yield pb.GenerateResponse(text="x" * 1024)
        finally:
            self.closed = True


def test_a_client_that_stops_reading_holds_the_stream_back_within_bounds():
    """A client that grants a 1 GiB window and then reads nothing: the endpoint stops taking
    messages once the socket's buffers are full (it never waits for flow control here), keeps
    its loop turning meanwhile, and closes the stream when the client goes."""

    async def go():
        flood = Flood(200_000)  # 200 MiB if nothing held it back
        endpoint = GrpcServer("127.0.0.1")
        await endpoint.start(service_methods(GENERATION, flood))
        try:
            client = await RawClient.connect(endpoint.endpoint)
            client.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: (1 << 31) - 1})
            client.h2.increment_flow_control_window(1 << 30)
            await client.send(grpc_headers(), frame(request(1).SerializeToString()))
            ticks = 0
            for _ in range(20):  # the loop turns while the flood is held back
                await asyncio.sleep(0.02)
                ticks += 1
            held_at = flood.made
            await asyncio.sleep(0.2)
            still = flood.made
            await client.close()
            await until(lambda: flood.closed)
        finally:
            await endpoint.stop(1.0)
        return ticks, held_at, still, flood

    ticks, held_at, still, flood = asyncio.run(go())
    assert ticks == 20
    assert held_at < 50_000 and still == held_at  # held back, ~tens of MiB at most
    assert flood.closed
