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
from cluster.serving.token_wire import KEY_BYTES, decode_items, merge_chunks, read_frame

log = logging.getLogger("ray.serve." + __name__)


class Subscription:
    """One request's stream of chunks, in order. Chunks that arrive while the reader is away
    (the request's next hop has not taken its previous message yet) wait here and are handed
    over together, as one chunk (`merge_chunks`): a stream that falls behind gets fewer,
    larger messages, while one that keeps up gets each step's chunk as soon as it arrives."""

    def __init__(self, server: TokenStreamServer, request_id: str) -> None:
        self.server = server
        self.request_id = request_id
        self.route = TokenRoute(server.endpoint, secrets.token_bytes(KEY_BYTES))
        self.chunks: list[WorkerChunk] = []  # arrived, not taken yet
        self.call: asyncio.Future | None = None  # the worker call, once it has ended
        self._waiter: asyncio.Future | None = None

    def watch(self, call: asyncio.Future) -> None:
        """End the stream with `call`'s outcome if the items stop (see `next`)."""
        call.add_done_callback(self._ended)

    def put(self, chunk: WorkerChunk) -> None:
        self.chunks.append(chunk)
        self._wake()

    def _ended(self, call: asyncio.Future) -> None:
        self.call = call
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> WorkerChunk:
        """Every chunk that arrived since the last call, as one. Raises the worker call's
        error once the chunks sent before it are taken, or Unavailable when the call has
        returned and no chunk comes within the grace period."""
        while not self.chunks:
            call = self.call
            if call is None:
                await self._wait()
            elif not call.cancelled() and call.exception() is not None:
                raise call.exception()
            else:
                try:
                    async with asyncio.timeout(self.server.grace_s):
                        await self._wait()
                except TimeoutError:
                    raise Unavailable(
                        "the worker finished but its token stream did not arrive"
                    ) from None
        chunks, self.chunks = self.chunks, []
        return merge_chunks(chunks)

    async def _wait(self) -> None:
        self._waiter = self.server.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

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
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once started
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> str:
        self.loop = asyncio.get_running_loop()
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
                    sub.put(chunk)
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
