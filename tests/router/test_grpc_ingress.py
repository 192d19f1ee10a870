"""The gRPC proxy's streaming handler, detached from grpc's writes (router/grpc_ingress.py), on
a real grpc.aio server on loopback. The handler inside is shaped like Ray Serve's proxy handler:
it cancels its call to the replica only when cancelled while it waits for the replica, and reads
the servicer context after its loop. (The real proxy is covered by tests/e2e/test_serving.py.)"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

import grpc
import pytest

from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.grpc_ingress import DetachableContext, add_generation_servicer, detach_stream

# The client announces a small receive window and never grows it, so a server that writes
# more than that while the client is not reading waits in grpc's write.
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
METHOD = "/t.Stream/Generate"


@dataclass
class ReplicaCall:
    """Stands in for the proxy's call to the router replica."""

    cancelled: bool = False
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    peer: str | None = None
    context_attached: bool | None = None  # after the loop


def serve_like(call: ReplicaCall, n: int, size: int, wait_s: float, fail_after: int = -1):
    async def handler(request: bytes, context):
        try:
            for i in range(n):
                if i == fail_after:
                    raise ValueError("replica failed")
                try:
                    await asyncio.sleep(wait_s)  # waiting for the replica's next message
                except asyncio.CancelledError:
                    call.cancelled = True  # the proxy cancels its call here, and only here
                    break
                yield bytes([i % 256]) * size
        finally:
            call.ended.set()
        call.context_attached = getattr(context, "attached", True)
        call.peer = context.peer()  # Serve's access log
        context.set_code(grpc.StatusCode.OK)

    return handler


async def start(handler) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    rpc = grpc.unary_stream_rpc_method_handler(handler)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("t.Stream", {"Generate": rpc}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def talk(handler, client, options=None):
    """Serve `handler` on loopback, run `client(stream)` on one call of it, stop the server."""
    server, target = await start(handler)
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        result = await client(channel.unary_stream(METHOD)(b"go"))
    await server.stop(None)
    return result


async def cancel_during_a_write(handler, call: ReplicaCall) -> None:
    """Read one message, stop reading until the server is stuck in a write, then cancel."""

    async def client(stream):
        assert await stream.read()
        await asyncio.sleep(0.5)
        stream.cancel()
        await asyncio.wait_for(call.ended.wait(), 10)

    await talk(handler, client, SMALL_WINDOW)


def test_messages_and_status_pass_through_with_the_live_context():
    async def client(stream):
        got = [m async for m in stream]
        assert await stream.code() == grpc.StatusCode.OK
        return got

    call = ReplicaCall()
    handler = detach_stream(serve_like(call, n=5, size=3, wait_s=0))
    got = asyncio.run(talk(handler, client))
    assert got == [bytes([i]) * 3 for i in range(5)]
    assert not call.cancelled
    assert call.context_attached
    assert call.peer is not None and "127.0.0.1" in call.peer


def test_an_error_of_the_handler_ends_the_stream_after_its_messages():
    async def client(stream):
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for m in stream:
                got.append(m)
        assert e.value.code() == grpc.StatusCode.UNKNOWN
        return got

    handler = detach_stream(serve_like(ReplicaCall(), n=5, size=3, wait_s=0, fail_after=2))
    assert len(asyncio.run(talk(handler, client))) == 2


def test_a_cancel_while_waiting_for_the_replica_cancels_the_call():
    call = ReplicaCall()

    async def client(stream):
        assert await stream.read()
        stream.cancel()
        await asyncio.wait_for(call.ended.wait(), 10)

    asyncio.run(talk(detach_stream(serve_like(call, n=50, size=3, wait_s=0.3)), client))
    assert call.cancelled


def test_a_cancel_during_a_write_cancels_the_call():
    async def go():
        call = ReplicaCall()
        await cancel_during_a_write(detach_stream(serve_like(call, 200, 64 << 10, 0.01)), call)
        assert call.cancelled
        # It wound down after grpc had ended the RPC: through the detached context.
        assert call.context_attached is False
        assert call.peer is not None and "127.0.0.1" in call.peer

    asyncio.run(go())


def test_without_it_a_cancel_during_a_write_leaves_the_call_running():
    """The control: the same handler served as it is loses the cancel, as Serve's proxy does."""

    async def go():
        call = ReplicaCall()
        await cancel_during_a_write(serve_like(call, 200, 64 << 10, 0.01), call)
        assert not call.cancelled

    asyncio.run(go())


class FakeContext:
    def __init__(self) -> None:
        self.codes: list[grpc.StatusCode] = []
        self.details: list[str] = []

    def set_details(self, details: str) -> None:
        self.details.append(details)

    def peer(self) -> str:
        return "ipv4:10.0.0.1:5000"

    def set_code(self, code: grpc.StatusCode) -> None:
        self.codes.append(code)

    def code(self) -> grpc.StatusCode | None:
        return self.codes[-1] if self.codes else None


def test_a_detached_context_answers_without_reaching_the_rpc():
    real = FakeContext()
    ctx = DetachableContext(real)
    ctx.set_code(grpc.StatusCode.OK)
    assert ctx.code() == grpc.StatusCode.OK
    ctx.detach()
    ctx.set_code(grpc.StatusCode.CANCELLED)
    assert ctx.code() is None
    assert real.codes == [grpc.StatusCode.OK]
    assert ctx.peer() == "ipv4:10.0.0.1:5000"


def test_on_serves_proxy_server_only_the_streaming_handlers_are_detached():
    from ray.serve._private.grpc_util import gRPCGenericServer

    made = []

    def factory(service_method: str, streaming_type):
        async def stream(request, context):
            yield b""

        async def unary(request, context):
            return b""

        handler = stream if "STREAM" in streaming_type.name.split("_", 1)[1] else unary
        made.append(handler)
        return handler

    async def go():
        server = gRPCGenericServer(factory)
        add_generation_servicer(pb_grpc.GenerationServicer(), server)
        assert server.service_handler_factory is factory
        handlers = server.generic_rpc_handlers[0][0]._method_handlers
        generate = handlers["/pdserve.v1.Generation/Generate"]
        assert "detach_stream" in generate.unary_stream.__qualname__
        assert inspect.isasyncgenfunction(generate.unary_stream)
        get_stats = handlers["/pdserve.v1.Generation/GetStats"].unary_unary
        assert "_with_status_mapping" in get_stats.__qualname__ and get_stats not in made

    asyncio.run(go())


def test_a_router_replica_gone_is_unavailable_not_internal():
    """Serve's proxy reports any actor error as INTERNAL; a dead router replica (Ray's words
    for it) becomes UNAVAILABLE, every other INTERNAL stays."""
    gone = [
        "The actor 57234f5d is unavailable: Actor is unavailable.. The task may or may not have "
        "been executed on the actor.",
        "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
    ]
    for details in gone:
        real = FakeContext()
        ctx = DetachableContext(real)
        ctx.set_code(grpc.StatusCode.INTERNAL)
        ctx.set_details(details)
        assert real.codes[-1] == grpc.StatusCode.UNAVAILABLE and real.details == [details]
    for code, details in [
        (grpc.StatusCode.INTERNAL, "KeyError: 'x'"),
        (grpc.StatusCode.INVALID_ARGUMENT, "The actor is unavailable"),
    ]:
        real = FakeContext()
        ctx = DetachableContext(real)
        ctx.set_code(code)
        ctx.set_details(details)
        assert real.codes == [code]
    ctx.detach()
    ctx.set_details("The actor died")
    assert real.details == ["The actor is unavailable"]
