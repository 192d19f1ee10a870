"""An OpenAI-compatible server for the bench's HTTP tests, in a thread of the test process:
`GET /v1/models`, streamed `POST /v1/completions` and `/v1/chat/completions` that answer each
request with `max_tokens` one-word chunks, a finish chunk (with `pdserve_timing` on
completions), a usage chunk and `[DONE]`; a prompt whose first token id is `REFUSED` gets a
429. It records every request body it was sent."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

BODIES = web.AppKey("bodies", list)
REFUSED = 17  # first prompt token id that gets HTTP 429
MODEL = "fake-model"
TIMING = {
    "queue_seconds": 0.001, "prefill_seconds": 0.002, "kv_transfer_seconds": 0.0005,
    "time_to_first_token_seconds": 0.004, "decode_seconds": 0.003, "total_seconds": 0.007,
    "prefill_replica": "p1", "decode_replica": "d1", "migrations": 0,
}  # fmt: skip


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "max_model_len": 256}]})


async def _generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[BODIES].append(body)
    chat = request.path.endswith("chat/completions")
    prompt = body.get("prompt") or [0]
    if not chat and prompt[0] == REFUSED:
        return web.json_response({"error": {"message": "overloaded"}}, status=429)
    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await resp.prepare(request)
    n = body["max_tokens"]
    for i in range(n):
        await asyncio.sleep(0.002)
        choice = {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "}
        await resp.write(_event({"choices": [{"index": 0, **choice, "finish_reason": None}]}))
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    if not chat:
        final["pdserve_timing"] = TIMING
    await resp.write(_event(final))
    n_prompt = len(prompt) if not chat else len(body["messages"][0]["content"].split())
    usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
    await resp.write(_event({"choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@contextmanager
def fake_openai_server() -> Iterator[tuple[str, list[dict]]]:
    """Yields the server's base URL (`http://127.0.0.1:PORT/v1`) and the bodies it receives."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app[BODIES] = []
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _generate)
    app.router.add_post("/v1/chat/completions", _generate)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1", app[BODIES]
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
