"""The token stream between a real engine thread and a real router-side server on
loopback: outputs arrive in order with the worker's extras, a broken or hostile connection
fails its streams and the engine frees their blocks, and a router that stops reading is
buffered up to a bound. The engine's greedy tokens are checked against the engine itself
(`Engine.generate`), which the oracle tests tie to transformers."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.errors import Unavailable
from cluster.request import Request, StepOutput
from cluster.serving.pool_messages import TokenRoute, WorkerChunk
from cluster.serving.token_wire import decode_items, read_frame
from decode_worker.token_sender import StreamSink, TokenSender, _Connection
from router.token_stream import TokenStreamServer
from tests.conftest import greedy, prompt

ARCH = "llama-gqa"


def chunk_maker(replica: str, hold=None):
    """Chunks as a decode worker makes them. `hold()`, if given, runs on the engine thread
    before every output after the first: the test decides when the stream goes on."""

    def make(out: StepOutput, first: bool) -> WorkerChunk:
        if not first and hold is not None:
            hold()
        return WorkerChunk(out, replica, kv_transfer_seconds=1.5 if first else 0.0)

    return make


def until(event: threading.Event):
    return lambda: event.wait(30)


async def collect(sub) -> list[WorkerChunk]:
    chunks = []
    while True:
        c = await asyncio.wait_for(sub.next(), 30)
        chunks.append(c)
        if c.output.finished:
            return chunks


async def used(engine: AsyncEngine) -> int:
    return await engine.call(lambda e: e.stats().kv_blocks_used)


@dataclass
class Rig:
    engine: AsyncEngine
    server: TokenStreamServer
    sender: TokenSender

    def run(self, req: Request, sink) -> asyncio.Future:
        rid = req.request_id
        return asyncio.ensure_future(self.engine.stream_to(rid, lambda e: e.add_request(req), sink))


@asynccontextmanager
async def rig(engine) -> AsyncIterator[Rig]:
    """A started engine thread, a router-side server and a worker-side sender on loopback."""
    r = Rig(AsyncEngine(engine), TokenStreamServer("127.0.0.1"), TokenSender())
    r.engine.start()
    await r.server.start()
    try:
        yield r
    finally:
        r.sender.close()
        await r.server.stop()
        await r.engine.stop()


def test_outputs_reach_their_subscriptions_in_order(model_dir, make_engine):
    path = model_dir(ARCH)
    reqs = [Request(f"r{i}", prompt(5 + 3 * i, i), greedy(6 + i)) for i in range(3)]
    expected = {r.request_id: make_engine(path).generate([r])[0].token_ids for r in reqs}

    async def go():
        async with rig(make_engine(path)) as t:
            subs = [t.server.subscribe(r.request_id) for r in reqs]
            sinks = [
                await t.sender.open(s.route, r.request_id, chunk_maker("w0"))
                for s, r in zip(subs, reqs, strict=True)
            ]
            runs = [t.run(r, sink) for r, sink in zip(reqs, sinks, strict=True)]
            got = await asyncio.gather(*(collect(s) for s in subs), *runs)
            assert len(t.sender._conns) == 1  # one connection carries every stream
            assert await used(t.engine) == 0
            return got[: len(reqs)]

    streams = asyncio.run(go())
    for r, chunks in zip(reqs, streams, strict=True):
        assert [t for c in chunks for t in c.output.token_ids] == expected[r.request_id]
        assert chunks[-1].output.finish_reason == "length"
        assert [c.kv_transfer_seconds for c in chunks[:2]] == [1.5, 0.0]
        assert {c.replica_id for c in chunks} == {"w0"}


def test_a_wrong_key_drops_the_connection_and_the_engine_aborts(model_dir, make_engine):
    path = model_dir(ARCH)

    async def go():
        async with rig(make_engine(path)) as t:
            sub = t.server.subscribe("r1")
            forged = TokenRoute(sub.route.endpoint, bytes(16))
            broken = threading.Event()  # the stream may not end before the drop is seen
            sink = await t.sender.open(forged, "r1", chunk_maker("w0", until(broken)))
            sink.done.add_done_callback(lambda _: broken.set())
            with pytest.raises(Unavailable):
                await asyncio.wait_for(t.run(Request("r1", prompt(6, 1), greedy(100)), sink), 30)
            assert not sub.chunks  # nothing with the wrong key was delivered
            assert await used(t.engine) == 0

    asyncio.run(go())


def test_router_going_away_mid_stream_aborts_the_request(model_dir, make_engine):
    path = model_dir(ARCH)

    async def go():
        async with rig(make_engine(path)) as t:
            sub = t.server.subscribe("r1")
            gone = threading.Event()
            sink = await t.sender.open(sub.route, "r1", chunk_maker("w0", until(gone)))
            run = t.run(Request("r1", prompt(6, 1), greedy(100)), sink)
            await asyncio.wait_for(sub.next(), 30)  # streaming has begun
            await t.server.stop()
            gone.set()
            with pytest.raises(Unavailable):
                await asyncio.wait_for(run, 30)
            assert await used(t.engine) == 0
            # A new router endpoint is reached on a fresh connection.
            server2 = TokenStreamServer("127.0.0.1")
            await server2.start()
            sub2 = server2.subscribe("r2")
            sink2 = await t.sender.open(sub2.route, "r2", chunk_maker("w0"))
            run2 = t.run(Request("r2", prompt(6, 2), greedy(3)), sink2)
            _, chunks = await asyncio.gather(run2, collect(sub2))
            assert sum(len(c.output.token_ids) for c in chunks) == 3
            await server2.stop()

    asyncio.run(go())


def test_cancelling_the_worker_call_aborts_and_frees(model_dir, make_engine):
    path = model_dir(ARCH)

    async def go():
        async with rig(make_engine(path)) as t:
            sub = t.server.subscribe("r1")
            cancelled = threading.Event()
            make = chunk_maker("w0", until(cancelled))
            async with t.sender.sink(sub.route, "r1", make) as sink:  # as the workers use it
                run = t.run(Request("r1", prompt(6, 1), greedy(100)), sink)
                await asyncio.wait_for(sub.next(), 30)
                run.cancel()
                cancelled.set()
                with pytest.raises(asyncio.CancelledError):
                    await run
            assert await used(t.engine) == 0
            assert not sink.conn.sinks and sink.conn.broken is None  # the connection lives on

    asyncio.run(go())


def test_unreachable_router_is_unavailable():
    async def go():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, not listening: connections are refused
            with pytest.raises(Unavailable):
                await TokenSender().open(TokenRoute(f"127.0.0.1:{port}", bytes(16)), "r", None)

    asyncio.run(go())


def test_a_router_that_stops_reading_gets_held_outputs_merged_then_is_cut_off():
    """While the socket holds bytes the router has not read, a stream's new outputs are held
    and merged: once the reader drains they arrive as one item, every token in order. Past
    `max_pending` bytes (pending and held) the connection is broken and its streams lost."""

    async def go():
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.setblocking(False)
        conn = _Connection(ours, loop, max_pending=1 << 20)

        class Sink:
            key, request_id = bytes(16), "r1"

        sent = 0

        def step() -> list[str]:
            nonlocal sent
            conn.add(Sink, WorkerChunk(StepOutput("r1", (sent,), "x" * 2000), "w0"))
            sent += 1
            return conn.flush()

        while not conn.pending:
            assert step() == []
        for _ in range(5):
            assert step() == []
        assert len(conn.held["r1"][1]) == 5  # held, not queued behind the pending bytes
        # Drain on the reader's side while the loop flushes the rest.
        reader, writer = await asyncio.open_connection(sock=theirs)
        items = []
        while sum(len(c.output.token_ids) for _, c in items) < sent:
            items.extend(decode_items(await asyncio.wait_for(read_frame(reader), 10)))
        assert [t for _, c in items for t in c.output.token_ids] == list(range(sent))
        merged = items[-1][1].output
        assert merged.token_ids == tuple(range(sent - 5, sent)) and merged.text == "x" * 10000
        assert not conn.pending and not conn.held and conn.broken is None
        # Now stop reading for good: held outputs pass the bound and the link breaks.
        conn.sinks["r1"] = Sink
        lost: list[str] = []
        while not lost:
            lost = step()
        assert lost == ["r1"] and isinstance(conn.broken, Unavailable)
        assert len(conn.pending) < 1 << 20  # bounded: one frame at most, the rest held
        writer.close()

    asyncio.run(go())


def interval_sink(interval: int) -> tuple[StreamSink, socket.socket]:
    """A sink of request "r1" with `interval` on a connection to a socketpair; the other end."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    conn = _Connection(ours, asyncio.get_running_loop(), max_pending=1 << 20)
    sink = StreamSink(conn, "r1", bytes(16), chunk_maker("w0"), interval=interval)
    conn.sinks["r1"] = sink
    return sink, theirs


def put(sink: StreamSink, i: int, reason=None, text: str = "") -> bool:
    """Output `i` of r1 (its token is `i`, its count i + 1) to `sink`; whether it went out."""
    tokens = () if reason == "abort" else (i,)
    target = sink.put(StepOutput("r1", tokens, text, reason, 3, i + 1))
    if target is not None:
        assert target is sink.conn and target.flush() == []
    return target is not None


async def items_to_the_end(theirs: socket.socket) -> list[WorkerChunk]:
    """The chunks read from the other end up to the finished one."""
    reader, writer = await asyncio.open_connection(sock=theirs)
    items: list = []
    while not items or not items[-1][1].output.finished:
        items.extend(decode_items(await asyncio.wait_for(read_frame(reader), 10)))
    writer.close()
    return [chunk for _, chunk in items]


def test_a_stream_interval_sends_the_first_token_at_once_then_every_n_merged():
    """`StreamSink` with interval 4 over 11 outputs (the last finishes the stream): the first
    goes alone, then groups of 4 tokens, then the 2 left with the finish reason; texts and
    the first chunk's phases ride along, and held outputs are not flushed."""

    async def go():
        sink, theirs = interval_sink(4)
        flushed = [put(sink, i, "length" if i == 10 else None, f"t{i}") for i in range(11)]
        assert flushed == [True, False, False, False, True, False, False, False, True, False, True]
        chunks = await items_to_the_end(theirs)
        assert [c.output.token_ids for c in chunks] == [(0,), (1, 2, 3, 4), (5, 6, 7, 8), (9, 10)]
        assert chunks[1].output.text == "t1t2t3t4"
        assert chunks[-1].output.finish_reason == "length"
        assert chunks[-1].output.num_output_tokens == 11
        assert [c.kv_transfer_seconds for c in chunks] == [1.5, 0.0, 0.0, 0.0]
        await sink.done  # settled once its last output went out

    asyncio.run(go())


def test_an_abort_flushes_the_outputs_held_for_the_interval():
    """An abort (a finished output without tokens) ends the hold: the held tokens go with
    it, so the router can pass them on before it resumes the stream elsewhere."""

    async def go():
        sink, theirs = interval_sink(8)
        assert [put(sink, i) for i in range(3)] == [True, False, False]
        assert put(sink, 2, "abort")
        chunks = await items_to_the_end(theirs)
        assert [(c.output.token_ids, c.output.finish_reason) for c in chunks] == [
            ((0,), None),
            ((1, 2), "abort"),
        ]

    asyncio.run(go())
