"""A worker's side of the token stream: step outputs go from the engine's output thread
straight to the router's `TokenStreamServer`, one frame per router connection per step. While
the router has not taken the previous frame (the socket holds bytes it did not send yet), a
step's outputs are held and merged per request, and go out as one frame when the socket
drains.

Yielding each token back through the Serve handle instead cost the worker's process several
event loop wake-ups per token, each taking the GIL from the engine thread in the middle of a
step (docs/findings.md has what it cost a token). Here the output thread
(`AsyncEngine`: it makes a step's outputs text while the engine runs the next) encodes and
sends the frame itself; the event loop only opens connections, flushes what the
socket could not take at once, and learns when a stream ends.

Ownership: a `TokenSender` owns one connection per router endpoint, shared by all streams to
that router. A `StreamSink` belongs to one request (`TokenSender.sink` opens it and forgets it
again); it is the `StepSink` the engine hands the request's outputs to (`AsyncEngine.stream_to`):
`put`, and `flush` on its connection, run on the output thread, everything else on the event
loop. A connection that breaks (the router went away, refused a frame, or stopped reading for
`max_pending_bytes`) fails every sink on it, and the engine aborts their requests, so no KV
blocks stay behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Callable

from cluster.errors import Unavailable
from cluster.request import StepOutput
from cluster.serving.pool_messages import TokenRoute, WorkerChunk
from cluster.serving.token_wire import encode_frame, encode_merged, merge_chunks

# Output thread: wraps a request's output for the router; (output, is it the first) -> chunk.
ChunkMaker = Callable[[StepOutput, bool], WorkerChunk]


class StreamSink:
    """Where one request's outputs go. `done` resolves after its last output was sent and
    fails if the connection broke first."""

    def __init__(
        self,
        conn: _Connection,
        request_id: str,
        key: bytes,
        make: ChunkMaker,
        interval: int = 1,
    ) -> None:
        self.conn = conn
        self.request_id = request_id
        self.key = key
        self.make = make
        self.interval = interval
        self.first: WorkerChunk | None = None
        self.waiting: list[WorkerChunk] = []  # outputs held for the stream interval
        self.waiting_tokens = 0
        self.done: asyncio.Future = conn.loop.create_future()

    def put(self, out: StepOutput) -> _Connection | None:
        """Output thread: queue the output on the connection (returned: the engine flushes
        it after the step's other outputs joined it). With a stream interval, outputs after
        the generation's first token (a decode worker's first output is its second) are held
        until they make `interval` tokens, or the stream ends, and go as one chunk (None
        returned while they are held)."""
        chunk = self.make(out, self.first is None)
        if self.first is None:
            self.first = chunk
        if self.interval > 1 and (out.num_output_tokens > 1 or self.waiting):
            self.waiting.append(chunk)
            self.waiting_tokens += len(out.token_ids)
            if self.waiting_tokens < self.interval and not out.finished:
                return None
            chunk = merge_chunks(self.waiting)  # one chunk as it is
            self.waiting, self.waiting_tokens = [], 0
        self.conn.add(self, chunk)
        return self.conn

    def fail(self, exc: BaseException) -> None:
        self.settle(exc)

    def settle(self, exc: BaseException | None) -> None:
        if self.done.done():
            return
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)
            self.done.exception()  # a sink nobody waits on any more may fail unobserved


class _Connection:
    """One socket to a router's token server, shared by every stream to that router. While
    the router has not taken the last frame (bytes are still pending in the socket) new
    outputs are held, merged per stream, and go out as one frame once it drains: a router
    that falls behind gets fewer, larger items instead of a growing queue of frames."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, max_pending: int
    ) -> None:
        self.sock = sock
        self.loop = loop
        self.max_pending = max_pending
        self.lock = threading.Lock()
        self.sinks: dict[str, StreamSink] = {}
        self.batch: list[tuple[StreamSink, WorkerChunk]] = []  # this step's, output thread
        self.held: dict[str, tuple[StreamSink, list[WorkerChunk]]] = {}  # under the lock
        self.held_bytes = 0  # about what the held chunks will take on the wire
        self.pending = bytearray()  # bytes the socket did not take yet
        self.broken: BaseException | None = None
        loop.add_reader(sock.fileno(), self._on_readable)

    def add(self, sink: StreamSink, chunk: WorkerChunk) -> None:
        self.batch.append((sink, chunk))

    def flush(self) -> list[str]:
        """Output thread: send this step's batch, or hold it while bytes are pending. Returns
        the request ids whose streams are lost (the connection broke), for the engine to
        abort."""
        batch, self.batch = self.batch, []
        with self.lock:
            if self.broken is None and not self.pending and not self.held:
                self._write(encode_frame([(sink.key, chunk) for sink, chunk in batch]))
                ended = self._ended([(sink, chunk) for sink, chunk in batch])
            else:
                self._hold(batch)
                ended = self._send_held() if self.broken is None and not self.pending else []
            failed = self.broken
            lost = list(self.sinks) if failed is not None else []
        for sink in ended:
            self.loop.call_soon_threadsafe(sink.settle, failed)
        if failed is not None:
            self.loop.call_soon_threadsafe(self._fail_all, failed)
        return lost

    def _hold(self, batch: list[tuple[StreamSink, WorkerChunk]]) -> None:
        """Under the lock: keep the batch's chunks for the next frame, after the held ones."""
        for sink, chunk in batch:
            entry = self.held.setdefault(sink.request_id, (sink, []))
            entry[1].append(chunk)
            out = chunk.output
            self.held_bytes += 64 + len(out.text) + 9 * len(out.token_ids)
        if len(self.pending) + self.held_bytes > self.max_pending:
            self.broken = Unavailable("the router stopped reading its token stream")

    def _send_held(self) -> list[StreamSink]:
        """Under the lock, nothing pending: write the held chunks, each stream's merged into
        one item. Returns the sinks whose last output went out."""
        held, self.held, self.held_bytes = self.held, {}, 0
        if not held:
            return []
        for frame in encode_merged([(sink.key, chunks) for sink, chunks in held.values()]):
            self._write(frame)
        return self._ended([(sink, chunks[-1]) for sink, chunks in held.values()])

    def _ended(self, sent: list[tuple[StreamSink, WorkerChunk]]) -> list[StreamSink]:
        """Under the lock: forget the sinks whose last output is among `sent`."""
        ended = [sink for sink, chunk in sent if chunk.output.finished]
        for sink in ended:
            self.sinks.pop(sink.request_id, None)
        return ended

    def _write(self, frame: bytes) -> None:
        """Under the lock: send now, or queue behind what is pending for the loop to flush."""
        if self.broken is not None:
            return
        if self.pending:
            self.pending += frame
        else:
            try:
                sent = self.sock.send(frame)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                self.broken = Unavailable(f"token stream to the router broke: {e}")
                return
            if sent < len(frame):
                self.pending += frame[sent:]
                self.loop.call_soon_threadsafe(self._watch_writable)
        if len(self.pending) > self.max_pending:
            self.broken = Unavailable("the router stopped reading its token stream")

    def _watch_writable(self) -> None:
        with contextlib.suppress(ValueError, OSError):  # closed meanwhile
            self.loop.add_writer(self.sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:
        """Loop thread: send what is pending; once it is all out, what was held meanwhile."""
        with self.lock:
            try:
                sent = self.sock.send(self.pending) if self.pending else 0
            except BlockingIOError:
                return
            except OSError as e:
                self.broken = Unavailable(f"token stream to the router broke: {e}")
                sent = len(self.pending)
            del self.pending[:sent]
            if self.pending:
                return
            ended = self._send_held() if self.broken is None else []
            failed, writing = self.broken, bool(self.pending)
        for sink in ended:
            sink.settle(failed)
        if writing and failed is None:
            return
        self.loop.remove_writer(self.sock.fileno())
        if failed is not None:
            self._fail_all(failed)

    def _on_readable(self) -> None:
        """The router never writes: readable means it closed the connection (or broke it)."""
        try:
            data = self.sock.recv(1)
        except BlockingIOError:
            return
        except OSError as e:
            data, reason = b"", str(e)
        else:
            reason = "closed by the router" if not data else "the router wrote to it"
        with self.lock:
            self.broken = self.broken or Unavailable(f"token stream connection {reason}")
        self._fail_all(self.broken)

    def _fail_all(self, exc: BaseException) -> None:
        """Loop thread: fail every open stream; their workers abort the requests."""
        with self.lock:
            sinks, self.sinks = list(self.sinks.values()), {}
        for sink in sinks:
            sink.settle(exc)
        self.close()

    def close(self) -> None:
        if self.sock.fileno() < 0:
            return
        self.loop.remove_reader(self.sock.fileno())
        self.loop.remove_writer(self.sock.fileno())
        self.sock.close()


class TokenSender:
    """This worker's connections to router token servers."""

    def __init__(self, connect_timeout_s: float = 10.0, max_pending_bytes: int = 64 << 20) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_pending_bytes = max_pending_bytes
        self._conns: dict[str, _Connection] = {}
        self._connecting: dict[str, asyncio.Future] = {}

    @contextlib.asynccontextmanager
    async def sink(
        self, route: TokenRoute, request_id: str, make: ChunkMaker, interval: int = 1
    ) -> AsyncIterator[StreamSink]:
        """`open` a sink for the body's stream; `discard` it when the body ends."""
        sink = await self.open(route, request_id, make, interval)
        try:
            yield sink
        finally:
            self.discard(sink)

    async def open(
        self, route: TokenRoute, request_id: str, make: ChunkMaker, interval: int = 1
    ) -> StreamSink:
        """A sink for `request_id` on the connection to `route.endpoint` (opened on first use),
        sending tokens after the first every `interval` (`StreamSink.put`). Raises Unavailable
        when the router cannot be reached."""
        conn = await self._connection(route.endpoint)
        sink = StreamSink(conn, request_id, route.key, make, interval)
        with conn.lock:
            if conn.broken is not None:
                raise conn.broken
            conn.sinks[request_id] = sink
        return sink

    def discard(self, sink: StreamSink) -> None:
        """Forget a sink that will get no more outputs (its request was aborted), and the
        outputs held for it."""
        with sink.conn.lock:
            sink.conn.sinks.pop(sink.request_id, None)
            sink.conn.held.pop(sink.request_id, None)

    async def _connection(self, endpoint: str) -> _Connection:
        conn = self._conns.get(endpoint)
        if conn is not None and conn.broken is None and conn.sock.fileno() >= 0:
            return conn
        pending = self._connecting.get(endpoint)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(endpoint))
            self._connecting[endpoint] = pending
            pending.add_done_callback(lambda _: self._connecting.pop(endpoint, None))
        return await asyncio.shield(pending)

    async def _connect(self, endpoint: str) -> _Connection:
        host, _, port = endpoint.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            sock = await asyncio.wait_for(
                asyncio.to_thread(socket.create_connection, (host, int(port))),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError, ValueError) as e:
            raise Unavailable(f"cannot reach the router's token stream at {endpoint}: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        conn = _Connection(sock, loop, self.max_pending_bytes)
        old = self._conns.get(endpoint)
        if old is not None:
            old.close()
        # Forget closed connections, e.g. to routers that autoscaling removed.
        self._conns = {e: c for e, c in self._conns.items() if c.sock.fileno() >= 0}
        self._conns[endpoint] = conn
        return conn

    def close(self) -> None:
        for conn in self._conns.values():
            conn._fail_all(Unavailable("the worker is shutting down"))
        self._conns.clear()
