"""Coalescing in Serve's gRPC proxy (router/grpc_ingress.py): the proxy's handler is read ahead
of the client's writes, and what arrived while a write was under way goes out as one
`GenerateResponse`. On a real grpc.aio server on loopback, with the wrappers the proxy uses
(`detach_stream(coalesce_stream(...))`) around a handler shaped like the proxy's: it yields
serialized messages, and cancels its call to the replica when cancelled while it waits."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from router.grpc_ingress import coalesce_stream, detach_stream, merge_responses

# The client announces a small receive window and never grows it: once that much is unread,
# the server's writes wait (a client slower than the stream, as flow control sees it).
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
METHOD = "/t.Stream/Generate"


def text(i: int) -> str:
    return f"<{i}>".ljust(32, ".")  # a 1 KiB window holds about 15 messages


def response(i: int, n: int) -> bytes:
    """Message i of an n-token stream: token 100 + i, its text; the last one finished."""
    msg = pb.GenerateResponse(request_id="r1", token_ids=[100 + i], text=text(i))
    msg.logprobs.add(logprob=-i / 10)
    if i == n - 1:
        msg.finish_reason = pb.FINISH_REASON_LENGTH
        msg.usage.prompt_tokens, msg.usage.completion_tokens = 3, n
        msg.timing.decode_replica = "d0"
    return msg.SerializeToString()


class Replica:
    """Stands in for the proxy's handler and its call to the router: `n` messages, `wait_s`
    apart, or each once `taken` is set; `cancelled` if cancelled while waiting."""

    def __init__(self, n: int, wait_s: float = 0.0, lockstep: bool = False) -> None:
        self.n, self.wait_s, self.lockstep = n, wait_s, lockstep
        self.taken = asyncio.Event()
        self.cancelled = False
        self.ended = asyncio.Event()

    async def handler(self, request: bytes, context):
        try:
            for i in range(self.n):
                try:
                    if self.lockstep and i > 0:
                        await self.taken.wait()
                        self.taken.clear()
                    await asyncio.sleep(self.wait_s)
                except asyncio.CancelledError:
                    self.cancelled = True
                    break
                yield response(i, self.n)
        finally:
            self.ended.set()


async def talk(replica: Replica, client, options=None):
    """Serve the wrapped handler on loopback and run `client(stream)` on one call."""
    server = grpc.aio.server()
    handler = detach_stream(coalesce_stream(replica.handler, merge_responses))
    rpc = grpc.unary_stream_rpc_method_handler(handler)  # bytes in, bytes out
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.Stream", {"Generate": rpc}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_stream(
                METHOD, response_deserializer=pb.GenerateResponse.FromString
            )
            return await client(call(b"go"))
    finally:
        await server.stop(None)


def test_a_slow_client_gets_every_token_in_order_in_fewer_messages():
    async def client(stream):
        got = []
        async for msg in stream:
            got.append(msg)
            await asyncio.sleep(0.2)  # reads one message per 200 ms
        return got

    got = asyncio.run(talk(Replica(200, wait_s=0.001), client, SMALL_WINDOW))
    assert [t for m in got for t in m.token_ids] == list(range(100, 300))
    assert "".join(m.text for m in got) == "".join(text(i) for i in range(200))
    assert [lp.logprob for m in got for lp in m.logprobs] == pytest.approx(
        [-i / 10 for i in range(200)]
    )
    assert len(got) < 200
    last = got[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 200)
    assert last.timing.decode_replica == "d0"
    assert all(not m.HasField("usage") for m in got[:-1])


def test_a_client_that_keeps_up_gets_each_message_as_it_comes():
    replica = Replica(30, lockstep=True)

    async def client(stream):
        got = []
        async for msg in stream:
            got.append(msg)
            replica.taken.set()
        return got

    got = asyncio.run(talk(replica, client))
    assert [m.SerializeToString() for m in got] == [response(i, 30) for i in range(30)]


def test_a_cancel_while_the_replica_is_awaited_cancels_its_call():
    replica = Replica(50, wait_s=0.3)

    async def client(stream):
        assert await stream.read()
        stream.cancel()
        await asyncio.wait_for(replica.ended.wait(), 10)

    asyncio.run(talk(replica, client))
    assert replica.cancelled


def test_a_cancel_while_a_write_waits_cancels_the_call():
    """The client stops reading until the server is stuck in a write, then cancels: the
    handler, still read ahead meanwhile, is cancelled at its wait."""
    replica = Replica(100_000, wait_s=0.001)

    async def client(stream):
        assert await stream.read()
        await asyncio.sleep(0.5)
        stream.cancel()
        await asyncio.wait_for(replica.ended.wait(), 10)

    asyncio.run(talk(replica, client, SMALL_WINDOW))
    assert replica.cancelled


def test_an_error_of_the_handler_comes_after_the_messages_before_it():
    async def failing(request, context):
        yield response(0, 5)
        yield response(1, 5)
        raise ValueError("replica failed")

    async def go():
        stream = coalesce_stream(failing, merge_responses)(b"", None)
        got = []
        with pytest.raises(ValueError, match="replica failed"):
            async for raw in stream:
                got.append(pb.GenerateResponse.FromString(raw))
        return got

    got = asyncio.run(go())
    assert [t for m in got for t in m.token_ids] == [100, 101]


def test_merged_responses_keep_tokens_text_logprobs_and_the_last_ones_status():
    merged = pb.GenerateResponse.FromString(merge_responses([response(i, 3) for i in range(3)]))
    assert list(merged.token_ids) == [100, 101, 102]
    assert merged.text == text(0) + text(1) + text(2)
    assert [lp.logprob for lp in merged.logprobs] == pytest.approx([0.0, -0.1, -0.2])
    assert merged.request_id == "r1" and merged.finish_reason == pb.FINISH_REASON_LENGTH
    assert merged.usage.completion_tokens == 3 and merged.timing.decode_replica == "d0"
