"""The router's direct endpoint (`router.direct.GrpcServer`, serving the router's methods) on
loopback: grpc's own clients get the service as from any gRPC server (messages, statuses and
their details, deadlines, cancellation, flow control, many streams on one connection, a stop
with a grace), and a raw HTTP/2 client (tests/router/direct/h2_client.py) gets a clear status
for what they never send. Every test ends with each generation the servicer opened closed
again (what frees its KV). Its limits: test_grpc_server_limits.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from cluster.errors import InvalidArgument
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.direct import GrpcServer, service_methods
from router.router import GENERATION
from tests.router.direct.h2_client import RawClient, frame, grpc_headers
from tests.router.direct.rig import (
    SMALL_WINDOW,
    Servicer,
    all_closed,
    connected,
    greedy,
    request,
    serving,
    until,
)
from tests.router.fake_service import FakeService
from tests.router.stream_rig import FIRST_TOKEN, RecordingMetrics, StepWorker, orchestrator


def test_streams_unary_calls_and_statuses_as_grpc_has_them():
    async def go():
        fake = FakeService()
        async with connected(fake) as (stub, channel):
            msgs = [m async for m in stub.Generate(request(5))]
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            codes = []
            fake.refuse = InvalidArgument("bad prompt: ünïcode 100% ✓", param="prompt")
            for call in (
                lambda: stub.Generate(request(3)).read(),
                lambda: stub.GetStats(pb.GetStatsRequest()),
                lambda: channel.unary_unary("/pdserve.v1.Generation/Nope")(b""),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call()
                codes.append((e.value.code(), e.value.details()))
        return msgs, info, codes, fake

    msgs, info, codes, fake = asyncio.run(go())
    assert [m.text for m in msgs] == [" t0", " t1", " t2", " t3", " t4"]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert (msgs[-1].usage.prompt_tokens, msgs[-1].usage.completion_tokens) == (5, 5)
    assert info.model_id == fake.model.model_id
    assert codes == [
        (grpc.StatusCode.INVALID_ARGUMENT, "bad prompt: ünïcode 100% ✓"),
        (grpc.StatusCode.UNKNOWN, "Unexpected RuntimeError: no code set"),
        (grpc.StatusCode.UNIMPLEMENTED, "method /pdserve.v1.Generation/Nope not found"),
    ]
    assert fake.opened == fake.closed == 2


def test_many_streams_share_one_connection():
    """More streams at once than h2's default limit of 100, on one channel."""

    async def go():
        fake = FakeService()
        async with connected(fake) as (stub, channel):

            async def one(i: int) -> list[str]:
                return [m.text async for m in stub.Generate(request(8, f"p{i}"))]

            return await asyncio.gather(*(one(i) for i in range(300))), fake

    texts, fake = asyncio.run(go())
    assert all(t == [f" t{i}" for i in range(8)] for t in texts)
    assert fake.opened == fake.closed == 300


def test_a_deadline_or_a_cancel_closes_the_generation():
    async def go():
        fake = FakeService()
        fake.hang_after_first = True
        async with connected(fake) as (stub, channel):
            call = stub.Generate(request(10), timeout=0.3)
            first = await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            await until(all_closed(fake))
            call = stub.Generate(request(10))
            await call.read()
            call.cancel()
            await until(lambda: fake.closed == 2)
        return first, e.value.code(), fake

    first, code, fake = asyncio.run(go())
    assert first.text == " t0" and code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.opened == fake.closed == 2


def test_a_deadline_and_a_reset_together_let_the_generation_close():
    """The client's deadline resets the stream as the server's own deadline ends the call:
    whichever lands first cancels the method, and the other must not cancel its clean-up
    (the generation's close, which frees its KV, takes 0.3 s here)."""

    async def go():
        fake = FakeService()
        fake.hang_after_first, fake.close_s = True, 0.3
        async with connected(fake) as (stub, channel):
            call = stub.Generate(request(10), timeout=0.1)
            await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            await until(all_closed(fake))
        return e.value.code(), fake

    code, fake = asyncio.run(go())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.opened == fake.closed == 1


def test_the_server_keeps_the_deadline_a_request_carries():
    """`grpc-timeout` alone, with no client deadline behind it: DEADLINE_EXCEEDED in the
    trailers after the first message, and the generation closed."""

    async def go():
        fake = FakeService()
        fake.hang_after_first = True
        async with serving(fake) as endpoint:
            client = await RawClient.connect(endpoint)
            body = frame(request(10).SerializeToString())
            answer = await client.call(grpc_headers(grpc_timeout=b"200m"), body)
            await client.close()
        return answer, fake

    answer, fake = asyncio.run(go())
    assert answer.headers[b":status"] == b"200"
    first = pb.GenerateResponse.FromString(answer.body[5:])
    assert first.text == " t0" and len(answer.body) == 5 + first.ByteSize()
    assert answer.trailers[b"grpc-status"] == b"4"
    assert fake.opened == fake.closed == 1


@pytest.mark.parametrize(
    ("headers", "body", "status", "grpc_status"),
    [
        (grpc_headers(), frame(b"\xff\xff"), b"200", b"13"),  # not a GenerateRequest
        (grpc_headers(), frame(b"", compressed=True), b"200", b"12"),
        (grpc_headers(), frame(b"")[:3], b"200", b"13"),  # a cut-off message
        (grpc_headers(), frame(b"") * 2, b"200", b"13"),  # two requests for a unary one
        (grpc_headers(grpc_encoding=b"gzip"), frame(b""), b"200", b"12"),
        (grpc_headers(grpc_timeout=b"soon"), frame(b""), b"200", b"3"),
        (grpc_headers(b"/pdserve.v1.Nope/Generate"), frame(b""), b"200", b"12"),
        (grpc_headers()[:4] + [(b"content-type", b"text/plain")], frame(b""), b"415", None),
        ([(b":method", b"GET"), *grpc_headers()[1:]], b"", b"405", None),
    ],
)
def test_what_no_grpc_client_sends_gets_a_clear_status(headers, body, status, grpc_status):
    async def go():
        fake = FakeService()
        async with serving(fake) as endpoint:
            client = await RawClient.connect(endpoint)
            answer = await client.call(headers, body)
            after = await client.call(grpc_headers(), frame(request(2).SerializeToString()))
            await client.close()
        return answer, after, fake

    answer, after, fake = asyncio.run(go())
    assert answer.headers[b":status"] == status
    assert answer.status.get(b"grpc-status") == grpc_status
    assert after.trailers[b"grpc-status"] == b"0"  # the connection keeps serving
    assert fake.opened == fake.closed == 1


def test_a_dropped_connection_closes_its_generations():
    async def go():
        fake = FakeService()
        fake.hang_after_first = True
        async with serving(fake) as endpoint:
            client = await RawClient.connect(endpoint)
            for _ in range(3):
                await client.send(grpc_headers(), frame(request(10).SerializeToString()))
            await until(lambda: fake.opened == 3)
            await client.close()
            await until(all_closed(fake))
        return fake

    fake = asyncio.run(go())
    assert fake.opened == fake.closed == 3


def test_a_stop_ends_calls_past_the_grace_unavailable_and_refuses_new_ones():
    async def go():
        fake = FakeService()
        fake.hang_after_first = True
        endpoint = GrpcServer("127.0.0.1")
        await endpoint.start(service_methods(GENERATION, Servicer(fake)))
        async with grpc.aio.insecure_channel(endpoint.endpoint) as channel:
            call = pb_grpc.GenerationStub(channel).Generate(request(10))
            await call.read()
            started = time.monotonic()
            await endpoint.stop(0.3)
            took = time.monotonic() - started
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.GenerationStub(channel).Generate(request(2), timeout=2).read()
        return took, ended.value.code(), refused.value.code(), fake

    took, ended, refused, fake = asyncio.run(go())
    assert 0.3 <= took < 2.0
    assert ended == grpc.StatusCode.UNAVAILABLE
    assert refused in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert fake.opened == fake.closed == 1


def test_a_slow_client_gets_every_token_in_order_in_fewer_messages():
    """The real orchestrator behind the endpoint (tests/router/stream_rig.py), a step every
    2 ms: a client with a small window reading one message per 20 ms holds the stream back
    by flow control once its window is full, and the router coalesces what it has not
    taken."""

    async def go():
        async with orchestrator(StepWorker(interval_s=0.002), RecordingMetrics()) as orch:
            async with connected(orch, SMALL_WINDOW) as (stub, _):
                msgs = []
                call = stub.Generate(
                    pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=greedy(400))
                )
                async for msg in call:
                    msgs.append(msg)
                    await asyncio.sleep(0.02)
                return msgs

    msgs = asyncio.run(go())
    assert [t for m in msgs for t in m.token_ids] == list(range(FIRST_TOKEN, FIRST_TOKEN + 400))
    assert len(msgs) < 200
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 400
    assert all(not m.HasField("usage") for m in msgs[:-1])
