"""Drive an `Engine` from asyncio: one engine thread, many concurrent request streams.

The engine is single-threaded, so everything that touches it (adding requests, aborting,
importing or exporting KV, reading stats) is sent to the engine thread as a command and runs
between two steps. The engine thread only steps: each step's token outputs go to an output
thread, which makes them text (detokenization and stop strings, `OutputProcessor`) while the
engine runs the next step, and hands them back to the event loop, one queue per request, or,
for a request admitted with `stream_to`, to its sink on the output thread itself (no event loop
wake-up per step; see decode_worker/token_sender.py). A stop string found there aborts the
request on the engine thread; the tokens it sampled meanwhile are dropped. Without an output
thread (`output_thread=False`, the serving default on a CPU, where both threads would want the
same cores and the GIL) the engine thread does that work itself after each step.

Fault domains. A request failed alone (`StepOutput.error`) has its stream or sink failed with
its error. Anything else that escapes `Engine.step` or the output processor fails the engine
(`_fail`): every stream fails with Unavailable (the router resumes it elsewhere), nothing more
is admitted, and `alive` turns false, so Serve's health check replaces the replica.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVCache, KVLayout
from cluster.engine.step_sink import Flushable, StepSink
from cluster.errors import NotFound, Unavailable
from cluster.request import Request, StepOutput

log = logging.getLogger("ray.serve." + __name__)

T = TypeVar("T")


@dataclass(frozen=True)
class _Failed:
    """Output queue item: the engine failed; it aborted `request_ids`, every stream fails."""

    exc: BaseException
    request_ids: list[str]


_END = object()  # output queue item: the engine thread has stopped


class AsyncEngine:
    def __init__(self, engine: Engine, output_thread: bool = True) -> None:
        """`output_thread` False: the engine thread does the output thread's work after
        each step (nothing overlaps, nothing contends for the GIL)."""
        self.engine = engine
        engine.detokenize_in_step = False  # `engine.output_processor` runs in `_handle`
        self.separate_output = output_thread
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], asyncio.Future | None]] = (
            queue.SimpleQueue()
        )
        self._outputs: queue.SimpleQueue[list[StepOutput] | _Failed | object] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[StepOutput | BaseException]] = {}
        # Added on the engine thread (before the request's first step), taken on the output
        # thread, dropped on either: single dict operations, safe under the GIL.
        self._sinks: dict[str, StepSink] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._output_thread: threading.Thread | None = None
        self.step_count = 0
        self.step_cpu_s = 0.0  # the engine thread's CPU time inside `Engine.step`
        self.fault: BaseException | None = None  # what failed the engine (set once)
        # Called on the engine thread once the engine failed and its streams were failed.
        self.on_fault: Callable[[BaseException], None] | None = None

    def start(self) -> None:
        """Start the engine and output threads; call from the event loop that will consume
        outputs. Each thread keeps the CPU mask of the thread that started it: see
        `start_engine_thread`."""
        self.start_engine_thread()
        if self._output_thread is None and self.separate_output:
            self._output_thread = threading.Thread(
                target=self._emit, name="pdserve-output", daemon=True
            )
            self._output_thread.start()

    def start_engine_thread(self) -> None:
        """Start the engine thread alone (e.g. pinned to the engine's cores) and leave the
        output thread to a later `start` (on the replica's own cores)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def native_id(self) -> int:
        """The engine thread's OS thread id (0 before it started)."""
        return (self._thread.native_id or 0) if self._thread is not None else 0

    @property
    def output_native_id(self) -> int:
        """The output thread's OS thread id (0 before it started)."""
        thread = self._output_thread
        return (thread.native_id or 0) if thread is not None else 0

    def cpu_seconds(self) -> tuple[float, float]:
        """(all, inside `Engine.step`) CPU seconds of the engine thread since it started; the
        difference is the loop's own work (commands, handing outputs over)."""
        return _thread_cpu_s(self._thread), self.step_cpu_s

    def output_cpu_seconds(self) -> float:
        """CPU seconds of the output thread (text, stop strings, sinks) since it started."""
        return _thread_cpu_s(self._output_thread)

    def alive(self) -> bool:
        """No fault failed the engine, the engine thread runs, and the output thread where
        there is one (an engine whose output thread died would serve no more text)."""
        threads = (self._thread, self._output_thread) if self.separate_output else (self._thread,)
        return self.fault is None and all(t is not None and t.is_alive() for t in threads)

    # -- from any thread, without waiting for a step ---------------------------------------

    @property
    def layout(self) -> KVLayout:
        """The KV pool's layout fingerprint (fixed when the engine was made)."""
        return self.engine.layout

    @property
    def device(self) -> torch.device:
        """Where the model and the KV pool live."""
        return self.engine.device

    @property
    def kv_pool(self) -> KVCache:
        """The paged KV pool, for a transport to register once (NIXL). Its blocks are read
        only under a lease's pin (see `read_held_kv`) and written only into blocks reserved
        for an import (`Engine.reserve_import`)."""
        return self.engine.kv_cache

    def read_held_kv(
        self, request_id: str, block_ids: list[int], read: Callable[[KVCache], T]
    ) -> T:
        """`read(pool)` on the calling thread, beside the engine thread, once the engine is
        seen to hold `request_id`'s prompt KV on exactly `block_ids` (NotFound if not).

        Only for blocks the caller keeps pinned (a lease's fetch, between the lease keeper's
        `begin_fetch` and `end_fetch`): while they are pinned the engine neither frees nor
        reuses them, and nothing writes them (a held sequence's prompt is complete; its full
        blocks are shared read-only through the prefix cache), so `read` sees settled data
        while the engine writes other blocks of the same pool. The check is one lookup, made
        under the GIL; the pin keeps its answer true for the rest of the read."""
        held, _ = self.engine.held_blocks(request_id)
        if held != block_ids:
            raise NotFound(f"the KV blocks of request {request_id!r} are no longer held")
        return read(self.engine.kv_cache)

    async def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        if self._output_thread is not None:
            self._outputs.put(_END)
            await asyncio.to_thread(self._output_thread.join)
            self._output_thread = None

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        self.start()
        fut: asyncio.Future = self._loop.create_future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await fut

    async def generate(self, request: Request) -> AsyncIterator[StepOutput]:
        """Queue `request` and yield its step outputs until it finishes. Closing the iterator
        early (client gone, task cancelled) aborts the request and frees its blocks."""
        return await self._stream(request.request_id, lambda e: e.add_request(request))

    async def stream_to(
        self, request_id: str, admit: Callable[[Engine], Any], sink: StepSink
    ) -> None:
        """Admit a request (`admit(engine)`, e.g. add or import it) whose outputs go to `sink`
        on the engine thread; return once its last output was taken. Cancelling the caller, or
        a broken sink, aborts the request and frees its blocks."""

        def add(engine: Engine) -> None:
            self._sinks[request_id] = sink
            try:
                admit(engine)
            except BaseException:
                del self._sinks[request_id]
                raise

        await self._admit(add, lambda e: self._drop_sink(e, request_id))
        try:
            await sink.done
        except BaseException:
            await asyncio.shield(self.call(lambda e: self._drop_sink(e, request_id)))
            raise

    def _drop_sink(self, engine: Engine, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None:
            engine.abort(request_id)

    async def _stream(self, request_id: str, admit: Callable[[Engine], Any]):
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        try:
            await self._admit(admit, lambda e: e.abort(request_id))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return self._drain(request_id, q)

    async def _admit(self, admit: Callable[[Engine], Any], undo: Callable[[Engine], Any]) -> None:
        """`call(admit)` (Unavailable once the engine failed); if the caller is cancelled
        meanwhile, the command still runs on the engine thread, so once it has admitted the
        request `undo` takes it out again."""
        admitted = asyncio.ensure_future(self.call(lambda e: self._healthy() and admit(e)))
        try:
            await asyncio.shield(admitted)
        except asyncio.CancelledError:
            admitted.add_done_callback(lambda f: self._undo_if_admitted(f, undo))
            raise

    def _healthy(self) -> bool:
        if self.fault is not None:
            raise Unavailable(f"this engine failed ({self.fault!r}); retry on another replica")
        return True

    def _undo_if_admitted(self, admitted: asyncio.Future, undo: Callable[[Engine], Any]) -> None:
        if not admitted.cancelled() and admitted.exception() is None:
            self._command(undo)

    def _command(self, fn: Callable[[Engine], Any]) -> None:
        """Any thread: run `fn(engine)` on the engine thread between steps, nobody waiting."""
        self._commands.put((fn, None))
        self._wake.set()

    async def _drain(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await asyncio.shield(self.call(lambda e: e.abort(request_id)))

    # -- engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._run_commands()
            if self.fault is not None or not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            began = time.thread_time()
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # the forward pass or the scheduler: the engine's
                self._fail(exc)
                continue
            finally:
                self.step_cpu_s += time.thread_time() - began
            self.step_count += 1
            if outputs:
                self._deliver(outputs)

    def _deliver(self, item: list[StepOutput] | _Failed) -> None:
        """Engine thread: outputs (or a failure) to the output thread, or handled here."""
        if self.separate_output:
            self._outputs.put(item)
        else:
            self._handle(item)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(self.engine)
            except BaseException as exc:
                if fut is None:
                    log.exception("engine command failed")
                else:
                    self._loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                if fut is not None:
                    self._loop.call_soon_threadsafe(_settle, fut, result, None)

    # -- output thread ---------------------------------------------------------------------

    def _emit(self) -> None:
        while (item := self._outputs.get()) is not _END:
            self._handle(item)

    def _handle(self, item: list[StepOutput] | _Failed) -> None:
        """Output thread (or the engine thread, without one): text, stop strings, sinks."""
        processor = self.engine.output_processor
        if isinstance(item, _Failed):
            processor.forget(item.request_ids)
            sinks = [self._sinks.pop(rid, None) for rid in item.request_ids]
            for sink in filter(None, sinks):
                self._loop.call_soon_threadsafe(sink.fail, item.exc)
            self._loop.call_soon_threadsafe(self._fail_streams, item.exc)
            return
        try:
            outputs, stopped = processor.process(item)
        except BaseException as exc:  # not one request's: the processor itself
            self._command(lambda e, exc=exc: self._fail(exc))
            return
        for request_id in stopped:
            self._command(lambda e, rid=request_id: e.abort(rid))
        if outputs and self._sinks:
            outputs = self._to_sinks(outputs)
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _to_sinks(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Output thread: hand outputs with a sink to it, one flush per connection; return
        the rest (for the event loop's queues)."""
        rest: list[StepOutput] = []
        touched: dict[int, Flushable] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                rest.append(out)
                continue
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if out.error is not None:
                self._loop.call_soon_threadsafe(sink.fail, out.error)
                continue
            conn = sink.put(out)
            if conn is not None:  # None: held for the request's stream interval
                touched[id(conn)] = conn
        for conn in touched.values():
            for request_id in conn.flush():
                self._command(lambda e, rid=request_id: self._drop_sink(e, rid))
        return rest

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out if out.error is None else out.error)

    def _fail(self, exc: BaseException) -> None:
        """Engine thread: mark the engine failed (nothing more is admitted or stepped), abort
        every request; the output thread fails every stream after the outputs before."""
        if self.fault is not None:
            return
        log.error("the engine failed; its streams fail over and it reports unhealthy", exc_info=exc)
        self.fault = exc
        ids = [rid for rid in list(self.engine.seqs) if self.engine.abort(rid)]
        self._deliver(_Failed(Unavailable(f"the engine of this replica failed: {exc!r}"), ids))
        if self.on_fault is not None:
            self.on_fault(exc)

    def _fail_streams(self, exc: BaseException) -> None:
        for q in self._streams.values():
            q.put_nowait(exc)


def _thread_cpu_s(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
