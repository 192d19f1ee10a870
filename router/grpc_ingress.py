"""How Serve's gRPC proxy serves `pdserve.v1.Generation`: the servicer function named in
`grpc_options.grpc_servicer_functions` (`cluster.serving.app.GRPC_SERVICER`), imported by the proxy
on every node.

It registers the generated service like `add_GenerationServicer_to_server`, with one change to
the streaming handlers the proxy makes for it. The proxy's handler (Ray 2.60,
`gRPCProxy.send_request_to_replica`) cancels its call to the router when it is cancelled while
it waits for the router's next message. When the client cancels while the proxy writes a
message to it, grpc abandons the handler at its `yield` instead and closes it later; the proxy
swallows that `GeneratorExit` without cancelling the call, and the router, and the worker
behind it, went on generating to `max_tokens` with the request's KV blocks held. Here a handler
closed at a `yield` is resumed once more and cancelled at its next wait, where the proxy does
cancel the call.

The proxy reads the router's messages as fast as they come, whatever the client takes, so a
client that reads slower than tokens are made would get a backlog of one-token messages. Here
`coalesce_stream` reads the proxy's handler in a task of its own and, each time grpc asks for
the next message (its previous write went out), hands over everything that arrived since as one
`GenerateResponse` (`merge_responses`); a client that keeps up gets each message at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from cluster.pb.grpc.health.v1 import health_pb2 as health_pb
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from router.proxy_priority import match_replica_niceness

StreamHandler = Callable[[Any, Any], AsyncIterator[Any]]  # (request, context) -> messages


def add_generation_servicer(servicer: Any, server: Any) -> None:
    """Register `pdserve.v1.Generation` and `grpc.health.v1.Health` (router/health.py) on
    `server`. On Serve's proxy server (which replaces every handler with one made by its
    `service_handler_factory`, calling the router's method of the RPC's name) the streaming
    handlers are `detach_stream` around `coalesce_stream` around the proxy's, and the proxy's
    threads move to the replicas' nice value; on any other server this is
    `add_GenerationServicer_to_server` and `add_health_check`."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        add_health_check(servicer, server)
        return

    match_replica_niceness()  # in Serve's proxy process (router/proxy_priority.py)

    def make(*args: Any, **kwargs: Any) -> Callable:
        handler = factory(*args, **kwargs)
        if inspect.isasyncgenfunction(handler):
            return detach_stream(coalesce_stream(handler, merge_responses))
        return _with_status_mapping(handler)

    server.service_handler_factory = make
    try:
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        add_health_check(servicer, server)
    finally:
        server.service_handler_factory = factory


def add_health_check(servicer: Any, server: Any) -> None:
    """Register `grpc.health.v1.Health/Check`, served by `servicer.Check` (a servicer without
    one serves no health); `Watch` is left out, so it is UNIMPLEMENTED (router/health.py)."""
    if getattr(servicer, "Check", None) is None:
        return
    check = grpc.unary_unary_rpc_method_handler(
        servicer.Check,
        request_deserializer=health_pb.HealthCheckRequest.FromString,
        response_serializer=health_pb.HealthCheckResponse.SerializeToString,
    )
    service = grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": check})
    server.add_generic_rpc_handlers((service,))


def detach_stream(handler: StreamHandler) -> StreamHandler:
    """A server-streaming handler that yields what `handler` yields and makes sure that
    leaving the stream reaches `handler` as a cancellation while it waits for its next message.
    Cancelled while waiting, `handler` is cancelled there already; closed at a `yield` (grpc
    abandoned it in a write), `handler` is resumed in a task of its own, which is cancelled
    at its first wait. `handler` sees the servicer context through a `DetachableContext`,
    detached when the stream is left at a `yield`: by then grpc may have ended the RPC and
    freed the call behind the real context."""

    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        seen_by_handler = DetachableContext(context)
        messages = handler(request, seen_by_handler)
        at_yield = False
        try:
            async for message in messages:
                at_yield = True
                yield message
                at_yield = False
        finally:
            if at_yield:
                seen_by_handler.detach()
                await _cancel_at_next_wait(messages)

    return stream


async def _cancel_at_next_wait(messages: AsyncIterator[Any]) -> None:
    """Resume `messages` from its `yield` and cancel it once it waits. A message it yields
    without waiting is dropped (the client is gone), and it is resumed again."""
    while True:
        step = asyncio.ensure_future(messages.__anext__())
        await asyncio.sleep(0)  # the step runs up to its first wait, or to its end
        if not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step
            return
        if step.cancelled() or step.exception() is not None:
            return  # ended (StopAsyncIteration) or failed: nothing left running


def coalesce_stream(handler: StreamHandler, merge: Callable[[list[Any]], Any]) -> StreamHandler:
    """A server-streaming handler that reads `handler`'s messages in a task of its own as they
    come, and yields, each time it is asked, all that arrived since the last yield: one as it
    is, several as `merge(messages)`. An error of `handler` is raised after the messages it
    sent before it. Leaving the stream cancels the task, so `handler` is cancelled at the wait
    it is in (for the proxy: waiting for the router's next message, where it cancels its call).
    """

    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        inbox = _Inbox()
        reader = asyncio.ensure_future(inbox.fill(handler(request, context)))
        try:
            while (batch := await inbox.take()) is not None:
                yield batch[0] if len(batch) == 1 else merge(batch)
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader

    return stream


class _Inbox:
    """Messages read ahead of the stream's writes: filled by one task, taken by another."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.ended = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future | None = None

    async def fill(self, messages: AsyncIterator[Any]) -> None:
        try:
            async for message in messages:
                self.messages.append(message)
                self._wake()
        except Exception as e:
            self.error = e
        finally:
            self.ended = True
            self._wake()

    async def take(self) -> list[Any] | None:
        """What arrived since the last take (waiting for at least one message); None at the
        end; the reader's error once its messages are taken."""
        while not self.messages:
            if self.ended:
                if self.error is not None:
                    raise self.error
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        batch, self.messages = self.messages, []
        return batch

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def merge_responses(messages: list[bytes]) -> bytes:
    """Consecutive serialized `GenerateResponse`s of one stream as one: tokens, text and
    logprobs in order; finish reason, usage and timing (only on the last message) kept."""
    parsed = [pb.GenerateResponse.FromString(raw) for raw in messages]
    merged = pb.GenerateResponse()
    for message in parsed:
        merged.MergeFrom(message)  # repeated fields appended, the rest the last one's
    merged.text = "".join(message.text for message in parsed)
    return merged.SerializeToString()


def _with_status_mapping(handler: Callable) -> Callable:
    """A unary handler that sees the context through a `DetachableContext` (never detached),
    for its status mapping."""

    async def unary(request: Any, context: Any) -> Any:
        return await handler(request, DetachableContext(context))

    return unary


# How Ray words an actor (here: the router replica) that died or cannot be reached.
_REPLICA_GONE = re.compile(r"\bactor\b.*\b(is unavailable|died|is dead)\b", re.I | re.S)


class DetachableContext:
    """A grpc servicer context that can be cut off from its RPC. Until `detach` every attribute
    is the real context's; after it, its methods do nothing and return None, except `peer`,
    which keeps answering the address read when the RPC began.

    It also corrects one status: the proxy reports a router replica that died under a call as
    INTERNAL (any `RayActorError` is INTERNAL to it), but a replica gone is UNAVAILABLE, the
    code that tells a client to retry. The proxy sets the code, then the details; the details
    show which it was."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._peer = context.peer()
        self.attached = True

    def detach(self) -> None:
        self.attached = False

    def peer(self) -> str:
        return self._peer

    def set_details(self, details: str) -> None:
        if not self.attached:
            return
        if self._context.code() == grpc.StatusCode.INTERNAL and _REPLICA_GONE.search(details):
            self._context.set_code(grpc.StatusCode.UNAVAILABLE)
        self._context.set_details(details)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._context, name)
        if self.attached or not callable(attr):
            return attr
        return _inert


def _inert(*_args: Any, **_kwargs: Any) -> None:
    return None
