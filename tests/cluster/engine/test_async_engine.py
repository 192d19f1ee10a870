"""`AsyncEngine`: a caller cancelled while its request is being admitted leaves nothing behind;
text and stop strings are made on the output thread, not the engine thread.

Commands run on the engine thread whether or not their caller still waits, so a cancel that
lands while the admit command is queued used to leave the request in the engine with nobody
reading it: a prefill-only prompt then stayed held for good."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.request import Request, RequestOutput, StepOutput
from tests.cluster.engine.test_output_processor import drive_requests, stop_requests
from tests.conftest import greedy, prompt


class _Sink:
    """A `StepSink` that takes every output and never finishes on its own."""

    def __init__(self) -> None:
        self.done = asyncio.get_running_loop().create_future()
        self.outputs: list[StepOutput] = []

    def put(self, out: StepOutput) -> _Sink:
        self.outputs.append(out)
        return self

    def flush(self) -> list[str]:
        return []

    def fail(self, exc: BaseException) -> None:
        pass


def test_a_prompt_whose_caller_is_cancelled_while_it_is_admitted_is_aborted(model_dir, make_engine):
    """Prefill-only, as the prefill pool runs it: left alone it would end held, for good."""
    engine = AsyncEngine(make_engine(model_dir("llama-gqa")))

    async def main() -> None:
        engine.start()
        try:
            for i in range(5):
                request = Request(f"r{i}", prompt(40, seed=i), greedy(8), prefill_only=True)
                call = asyncio.ensure_future(engine.generate(request))
                await _cancel_after(call, i)
                (stream,) = await asyncio.gather(call, return_exceptions=True)
                if not isinstance(stream, asyncio.CancelledError):
                    await stream.aclose()  # admitted before the cancel: closing it aborts it
            assert await _emptied(engine)
        finally:
            await engine.stop()

    asyncio.run(main())


def test_a_stream_whose_caller_is_cancelled_while_it_is_admitted_stops_at_once(
    model_dir, make_engine
):
    """Decoding into a sink, as the decode pool runs it: left alone it would decode to
    max_tokens into a sink nobody reads."""
    engine = AsyncEngine(make_engine(model_dir("llama-gqa")))

    async def main() -> None:
        engine.start()
        sinks = []
        try:
            for i in range(5):
                request = Request(f"r{i}", prompt(20, seed=i), greedy(100))
                sinks.append(_Sink())
                admit = lambda e, r=request: e.add_request(r)  # noqa: E731
                call = asyncio.ensure_future(engine.stream_to(f"r{i}", admit, sinks[-1]))
                await _cancel_after(call, i)
                with pytest.raises(asyncio.CancelledError):
                    await call
            assert await _emptied(engine)
            assert all(len(s.outputs) < 10 for s in sinks), [len(s.outputs) for s in sinks]
        finally:
            await engine.stop()

    asyncio.run(main())


class _Collector:
    """A `StepSink` that gathers a request's outputs and is done after its last one."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.output: RequestOutput | None = None

    def put(self, out: StepOutput) -> _Collector:
        self.output = self.output or RequestOutput(out.request_id)
        self.output.add(out)
        if out.finished:
            self.loop.call_soon_threadsafe(self.done.set_result, None)
        return self

    def flush(self) -> list[str]:
        return []

    def fail(self, exc: BaseException) -> None:
        self.done.set_exception(exc)


@pytest.mark.parametrize(
    "output_thread, made_on", [(True, "pdserve-output"), (False, "pdserve-engine")]
)
def test_text_and_stop_strings_are_made_on_the_output_thread(
    tokenizer_model_dir, make_engine, monkeypatch, output_thread, made_on
):
    """Streams (`generate`) and sinks (`stream_to`) get the text and finish reasons of an
    engine that detokenizes in its step; every token is detokenized on the output thread (or,
    without one, on the engine thread after its step), and the requests that stop strings
    ended leave no block behind."""
    requests = stop_requests(make_engine(tokenizer_model_dir, block_size=4))
    want = drive_requests(make_engine(tokenizer_model_dir, block_size=4), requests)
    threads: set[str] = set()
    add = IncrementalDetokenizer.add

    def recorded_add(self, token_id: int) -> bool:
        threads.add(threading.current_thread().name)
        return add(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", recorded_add)
    engine = AsyncEngine(make_engine(tokenizer_model_dir, block_size=4), output_thread)

    async def streamed(request: Request) -> RequestOutput:
        result = RequestOutput(request.request_id)
        async for out in await engine.generate(request):
            result.add(out)
        return result

    async def sunk(request: Request) -> RequestOutput:
        sink = _Collector()
        await engine.stream_to(request.request_id, lambda e: e.add_request(request), sink)
        return sink.output

    async def main() -> list[RequestOutput]:
        engine.start()
        try:
            calls = [streamed(r) if i % 2 else sunk(r) for i, r in enumerate(requests)]
            got = await asyncio.gather(*calls)
            assert await _emptied(engine)
            return got
        finally:
            await engine.stop()

    for request, out in zip(requests, asyncio.run(main()), strict=True):
        w = want[request.request_id]
        assert (out.token_ids, out.text, out.finish_reason) == (
            w.token_ids,
            w.text,
            w.finish_reason,
        ), request.request_id
    assert threads == {made_on}


async def _cancel_after(call: asyncio.Future, loop_turns: int) -> None:
    """Cancel `call` after a few turns of the event loop: at different points of the admit."""
    for _ in range(loop_turns):
        await asyncio.sleep(0)
    call.cancel()


async def _emptied(engine: AsyncEngine) -> bool:
    """True once the engine holds no sequence and no block (within a second)."""
    for _ in range(50):
        if await engine.call(lambda e: (len(e.seqs), e.stats().kv_blocks_used)) == (0, 0):
            return True
        await asyncio.sleep(0.02)
    return False


def test_alive_needs_both_the_engine_and_the_output_thread(model_dir, make_engine):
    """Serve's health check asks `alive`: an engine without its output thread serves no text."""
    engine = AsyncEngine(make_engine(model_dir("llama-gqa")))

    async def main() -> list[bool]:
        seen = [engine.alive()]
        engine.start_engine_thread()
        seen.append(engine.alive())
        engine.start()
        seen.append(engine.alive())
        assert engine.output_native_id not in (0, engine.native_id)
        await engine.stop()
        return [*seen, engine.alive()]

    assert asyncio.run(main()) == [False, False, True, False]


def test_without_an_output_thread_the_engine_thread_alone_is_alive(model_dir, make_engine):
    engine = AsyncEngine(make_engine(model_dir("llama-gqa")), output_thread=False)

    async def main() -> list[bool]:
        seen = [engine.alive()]
        engine.start()
        seen.append(engine.alive())
        assert engine.output_native_id == 0
        await engine.stop()
        return [*seen, engine.alive()]

    assert asyncio.run(main()) == [False, True, False]
