"""How Serve's gRPC proxy serves `pdserve.v1.Generation`: the servicer function named in
`grpc_options.grpc_servicer_functions` (`cluster.app.GRPC_SERVICER`), imported by the proxy
on every node.

It registers the generated service like `add_GenerationServicer_to_server`, with one change to
the streaming handlers the proxy makes for it. The proxy's handler forwards the router's
messages one at a time and yields each to grpc while its call to the router waits at the
`yield`. When the client cancels during a write, grpc abandons the handler there, and the
proxy (Ray 2.60, `gRPCProxy.send_request_to_replica`) swallows the `GeneratorExit` without
cancelling the call: the router, and the worker behind it, went on generating to `max_tokens`
with the request's KV blocks held. Here the proxy's handler runs in a task of its own that
only ever waits for the router; its messages reach grpc through a queue. However the client
leaves (cancelled while waiting, or closed after a write), the task is cancelled while it
waits on the router, which is where the proxy does cancel the call.

The queue is unbounded: a client that reads slower than tokens come keeps them in the proxy
(tens of bytes each, at most `max_tokens` of them per stream) instead of pausing the router.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

StreamHandler = Callable[[Any, Any], AsyncIterator[Any]]  # (request, context) -> messages
_END = object()


def add_generation_servicer(servicer: Any, server: Any) -> None:
    """Register `pdserve.v1.Generation` on `server`. On Serve's proxy server (which replaces
    every handler with one made by its `service_handler_factory`) the streaming handlers are
    made by `detach_stream` around the proxy's; on any other server this is
    `add_GenerationServicer_to_server`."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None:
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        return

    def make(*args: Any, **kwargs: Any) -> Callable:
        handler = factory(*args, **kwargs)
        return detach_stream(handler) if inspect.isasyncgenfunction(handler) else handler

    server.service_handler_factory = make
    try:
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
    finally:
        server.service_handler_factory = factory


def detach_stream(handler: StreamHandler) -> StreamHandler:
    """A server-streaming handler that yields what `handler` yields, with `handler` run in a
    task of its own so that it never waits at a `yield`. Leaving the returned stream, by
    cancellation or by `aclose`, cancels that task; an error `handler` raises is raised here
    after the messages before it. `handler` sees the servicer context through a
    `DetachableContext`, detached when the stream is left: the RPC may be over by the time the
    task has wound down, and grpc's call behind the real context is gone then."""

    async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
        queue: asyncio.Queue = asyncio.Queue()
        seen_by_handler = DetachableContext(context)
        task = asyncio.create_task(_pump(handler(request, seen_by_handler), queue))
        try:
            while (message := await queue.get()) is not _END:
                yield message
        finally:
            if not task.done():
                seen_by_handler.detach()
                task.cancel()
            task.add_done_callback(_seen)
        task.result()

    return stream


class DetachableContext:
    """A grpc servicer context that can be cut off from its RPC. Until `detach` every attribute
    is the real context's; after it, its methods do nothing and return None, except `peer`,
    which keeps answering the address read when the RPC began."""

    def __init__(self, context: Any) -> None:
        self._context = context
        self._peer = context.peer()
        self.attached = True

    def detach(self) -> None:
        self.attached = False

    def peer(self) -> str:
        return self._peer

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._context, name)
        if self.attached or not callable(attr):
            return attr
        return _inert


def _inert(*_args: Any, **_kwargs: Any) -> None:
    return None


async def _pump(messages: AsyncIterator[Any], queue: asyncio.Queue) -> None:
    try:
        async for message in messages:
            queue.put_nowait(message)
    except asyncio.CancelledError:
        return  # the client left; `messages` has seen the cancellation and ended its call
    finally:
        queue.put_nowait(_END)


def _seen(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # nobody reads the stream any more: no "never retrieved" warning
