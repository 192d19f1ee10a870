"""Coalescing under backpressure in the router (router/token_stream.py, router/orchestrator.py):
a request whose previous chunk its next hop has not taken yet gets the steps that arrived
meanwhile as one chunk; a request that keeps up gets one chunk per engine step, at once. The
metrics stay exact: one inter-token latency observation per token. The same for the OpenAI
SSE stream, whose events carry several tokens' text when the HTTP side is behind. Real
orchestrator, token server and sender on loopback (tests/router/stream_rig.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI

from cluster.sampling_params import SamplingParams
from router.openai_api import install_error_handlers, openai_routes
from tests.router.stream_rig import (
    FIRST_TOKEN,
    PROMPT,
    RecordingMetrics,
    StepWorker,
    orchestrator,
    step_text,
)

ITL = "pdserve_inter_token_latency_seconds"


async def read(orch, max_tokens: int, pause_s: float = 0.0, taken=None) -> list:
    """The chunks of one greedy request, pausing `pause_s` after each (a next hop that takes
    one message per pause); `taken` is set after each chunk is read."""
    request = await orch.build_request(None, list(PROMPT), SamplingParams(max_tokens, 0.0), "r1")
    chunks = []
    async for chunk in orch.generate(request):
        chunks.append(chunk)
        if taken is not None:
            taken.set()
        await asyncio.sleep(pause_s)
    return chunks


def test_a_slow_reader_gets_every_token_in_order_in_fewer_messages():
    async def go():
        metrics = RecordingMetrics()
        async with orchestrator(StepWorker(interval_s=0.004), metrics) as orch:
            return await read(orch, 200, pause_s=0.2), metrics

    chunks, metrics = asyncio.run(go())
    assert [t for c in chunks for t in c.token_ids] == list(range(FIRST_TOKEN, FIRST_TOKEN + 200))
    assert "".join(c.text for c in chunks) == "".join(step_text(i) for i in range(200))
    assert len(chunks) < 200
    assert max(len(c.token_ids) for c in chunks) > 1
    last = chunks[-1]
    assert last.finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT), 200)
    # Exact metrics: one ITL value per token after the first chunk's, adding up to the
    # decode time the last message reports.
    itl = metrics.observed[ITL]
    assert len(itl) == 200 - len(chunks[0].token_ids)
    assert sum(itl) == pytest.approx(last.timing.decode_seconds, rel=1e-6)


def test_a_reader_that_keeps_up_gets_one_message_per_step():
    async def go():
        worker = StepWorker(lockstep=True)
        async with orchestrator(worker, RecordingMetrics()) as orch:
            return await read(orch, 40, taken=worker.taken)

    chunks = asyncio.run(go())
    assert [c.token_ids for c in chunks] == [(FIRST_TOKEN + i,) for i in range(40)]
    assert [c.text for c in chunks] == [step_text(i) for i in range(40)]


async def sse_events(app: FastAPI, body: dict, send_s: float) -> list[str]:
    """POST `body` to /v1/completions on `app` through a bare ASGI server whose every send of
    a body part takes `send_s` (a next hop slower than the tokens); the SSE events it got."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    requested = asyncio.Event()
    parts: list[bytes] = []

    async def receive():
        if not requested.is_set():
            requested.set()
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            parts.append(message["body"])
            await asyncio.sleep(send_s)

    await app(scope, receive, send)
    return [e for e in b"".join(parts).decode().split("\n\n") if e]


def test_the_openai_stream_coalesces_when_its_sends_fall_behind():
    async def go():
        async with orchestrator(StepWorker(interval_s=0.004), RecordingMetrics()) as orch:
            app = FastAPI()
            app.include_router(openai_routes(lambda: orch))
            install_error_handlers(app)
            body = {"model": "tiny", "prompt": list(PROMPT), "max_tokens": 120, "stream": True}
            return await sse_events(app, {**body, "temperature": 0}, send_s=0.2)

    events = asyncio.run(go())
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == "".join(step_text(i) for i in range(120))
    assert len(chunks) < 120 and max(len(t) for t in texts) > len(step_text(119))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
