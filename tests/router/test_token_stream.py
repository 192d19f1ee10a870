"""The router's token stream server on its own: how a subscription ends when the worker call
ends, and what it does with items nobody waits for (frames written by hand on loopback)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.errors import FailedPrecondition, InvalidArgument, Unavailable
from cluster.request import StepOutput
from cluster.serving.pool_messages import WorkerChunk
from cluster.serving.token_wire import encode_frame
from router.token_stream import TokenStreamServer


def chunk(rid: str, token: int, finish: str | None = None) -> WorkerChunk:
    return WorkerChunk(StepOutput(rid, (token,), "t", finish), "w0")


async def connected(server: TokenStreamServer):
    host, port = server.endpoint.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


def test_items_sent_before_the_call_failed_come_first_merged_then_its_error():
    async def go():
        server = TokenStreamServer("127.0.0.1")
        await server.start()
        sub = server.subscribe("r1")
        _, writer = await connected(server)
        writer.write(
            encode_frame([(sub.route.key, chunk("r1", 1)), (sub.route.key, chunk("r1", 2))])
        )
        await writer.drain()
        await asyncio.sleep(0.2)  # the items are queued before the call's outcome
        call = asyncio.get_running_loop().create_future()
        sub.watch(call)
        call.set_exception(FailedPrecondition("layout mismatch"))
        # Both arrived before anyone asked: they come as one chunk, in order.
        assert (await sub.next()).output.token_ids == (1, 2)
        with pytest.raises(FailedPrecondition):
            await sub.next()
        writer.close()
        await server.stop()

    asyncio.run(go())


def test_a_call_that_returned_without_its_last_item_times_out_as_unavailable():
    async def go():
        server = TokenStreamServer("127.0.0.1", grace_s=0.3)
        await server.start()
        sub = server.subscribe("r1")
        _, writer = await connected(server)
        call = asyncio.get_running_loop().create_future()
        sub.watch(call)
        call.set_result(None)
        # One late item still counts; after it the grace applies again, not an endless wait.
        writer.write(encode_frame([(sub.route.key, chunk("r1", 1))]))
        await writer.drain()
        assert (await asyncio.wait_for(sub.next(), 5)).output.token_ids == (1,)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(sub.next(), 5)
        writer.close()
        await server.stop()

    asyncio.run(go())


def test_items_for_requests_nobody_waits_for_are_ignored():
    async def go():
        server = TokenStreamServer("127.0.0.1")
        await server.start()
        sub = server.subscribe("mine")
        _, writer = await connected(server)
        mine = chunk("mine", 2, "stop")
        writer.write(encode_frame([(bytes(16), chunk("gone", 1)), (sub.route.key, mine)]))
        await writer.drain()
        assert await asyncio.wait_for(sub.next(), 10) == mine
        writer.close()
        await server.stop()

    asyncio.run(go())


def test_a_malformed_frame_drops_the_connection_not_the_server():
    async def go():
        server = TokenStreamServer("127.0.0.1")
        await server.start()
        sub = server.subscribe("r1")
        reader, writer = await connected(server)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the server
        _, writer2 = await connected(server)
        writer2.write(encode_frame([(sub.route.key, chunk("r1", 3, "length"))]))
        await writer2.drain()
        assert (await asyncio.wait_for(sub.next(), 10)).output.finish_reason == "length"
        writer2.close()
        await server.stop()

    asyncio.run(go())


def test_subscribing_twice_to_one_request_is_refused():
    async def go():
        server = TokenStreamServer("127.0.0.1")
        await server.start()
        sub = server.subscribe("r1")
        with pytest.raises(InvalidArgument):
            server.subscribe("r1")
        sub.close()
        server.subscribe("r1").close()
        await server.stop()

    asyncio.run(go())
