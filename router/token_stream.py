"""The router's side of the token stream: a TCP server that workers send step outputs to
(decode_worker/token_sender.py), and the per-request subscriptions that read them.

A request subscribes before its worker call is made and gets a `TokenRoute` (this server's
endpoint and a fresh 16-byte random key) to pass to the worker; leaving the subscription's
`with` block ends it. Items are delivered to the subscription whose request id they name, and
only if they carry its key; an item with a wrong key, or a frame that fails `token_wire`'s
checks, drops the whole connection (the worker then aborts its streams on it). Items for a
request nobody waits for any more are ignored.

The worker call itself is a Serve handle call that lasts as long as the stream, so Serve's
routing, queue limits, autoscaling and cancellation see the request; the subscription ends the
stream when the call fails, or when it returned but the last item did not follow within
`grace_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets

from cluster.errors import InvalidArgument, Unavailable
from cluster.serving.pool_messages import TokenRoute, WorkerChunk
from cluster.serving.token_wire import KEY_BYTES, decode_items, read_frame

log = logging.getLogger(__name__)


class Subscription:
    """One request's stream of chunks, in order."""

    def __init__(self, server: TokenStreamServer, request_id: str) -> None:
        self.server = server
        self.request_id = request_id
        self.route = TokenRoute(server.endpoint, secrets.token_bytes(KEY_BYTES))
        self.queue: asyncio.Queue[WorkerChunk | asyncio.Future] = asyncio.Queue()
        self.call: asyncio.Future | None = None  # the worker call, once it has ended

    def watch(self, call: asyncio.Future) -> None:
        """End the stream with `call`'s outcome if the items stop (see `next`)."""
        call.add_done_callback(self.queue.put_nowait)

    async def next(self) -> WorkerChunk:
        """The next chunk. Raises the worker call's error, or Unavailable when the call has
        returned and the next item does not come within the grace period."""
        while True:
            if self.call is not None and self.queue.empty():
                try:
                    item = await asyncio.wait_for(self.queue.get(), self.server.grace_s)
                except TimeoutError:
                    raise Unavailable(
                        "the worker finished but its token stream did not arrive"
                    ) from None
            else:
                item = await self.queue.get()
            if isinstance(item, WorkerChunk):
                return item
            self.call = item  # the call ended: its error, if any, ends the stream
            if not item.cancelled() and item.exception() is not None:
                raise item.exception()

    def close(self) -> None:
        self.server._subs.pop(self.request_id, None)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class TokenStreamServer:
    def __init__(self, host: str, port: int = 0, grace_s: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.grace_s = grace_s
        self.endpoint = ""
        self._subs: dict[str, Subscription] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        port = self._server.sockets[0].getsockname()[1]
        self.endpoint = f"{self.host}:{port}"
        return self.endpoint

    def subscribe(self, request_id: str) -> Subscription:
        if request_id in self._subs:
            raise InvalidArgument(f"request id {request_id!r} is already streaming")
        sub = Subscription(self, request_id)
        self._subs[request_id] = sub
        return sub

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        peer = writer.get_extra_info("peername")
        try:
            while (payload := await read_frame(reader)) is not None:
                for key, chunk in decode_items(payload):
                    sub = self._subs.get(chunk.output.request_id)
                    if sub is None:
                        continue  # cancelled or timed out here: the worker aborts it soon
                    if not hmac.compare_digest(key, sub.route.key):
                        raise InvalidArgument(f"wrong stream key for {sub.request_id!r}")
                    sub.queue.put_nowait(chunk)
        except InvalidArgument as e:
            log.warning("dropping token stream from %s: %s", peer, e.message)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._conns):
            task.cancel()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()
        self._server = None
