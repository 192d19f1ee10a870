"""The OpenAI HTTP API against an orchestrator double, driven raw and by the official client.

The double speaks the `Orchestrator` API with canned tokens (" t0", " t1", ...), so these tests
pin the HTTP contract: shapes, statuses, streaming, and that every generator opened is closed.
The real end-to-end path is tested with the cluster.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from dataclasses import replace
from types import SimpleNamespace

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PdServeError,
    ResourceExhausted,
    Unavailable,
)
from cluster.request import Request, TokenLogprobs
from cluster.sampling_params import SamplingParams
from router.generation_chunk import GenerationChunk, Timing, Usage
from router.openai_api import install_error_handlers, openai_routes

MODEL = "tiny-llama"
MODEL_ID = "tiny-llama@0123abcd"
SERVER_MAX_TOKENS = 8
TIMING = Timing(0.001, 0.002, 0.003, 0.004, 0.005, 0.006, "prefill-0", "decode-0")


class FakeOrchestrator:
    """Generates `max_tokens` tokens " t0", " t1", ...; a stop string ends it early with "stop".
    Knobs: `refuse` (raised on the first `anext`), `fail_at` (raised before token i),
    `hang_after_first`, `last_reason` (overrides the final finish reason)."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(model_id=MODEL_ID, max_model_len=128)
        self.config = SimpleNamespace(model=SimpleNamespace(path=f"/ckpts/{MODEL}"))
        self.refuse: BaseException | None = None
        self.fail_at: tuple[int, BaseException] | None = None
        self.hang_after_first = False
        self.last_reason: str | None = None
        self.requests: list[Request] = []
        self.messages: list[dict] | None = None
        self.opened = self.closed = 0

    def model_names(self) -> tuple[str, str]:
        return (MODEL, MODEL_ID)

    def token_text(self, token_id: int) -> str:
        return f" t{token_id}"

    def sampling_params(self, max_tokens: int | None = None, **fields) -> SamplingParams:
        fields = {k: v for k, v in fields.items() if v is not None}
        params = SamplingParams(
            max_tokens=SERVER_MAX_TOKENS if max_tokens is None else max_tokens, **fields
        )
        if params.seed is None and not params.greedy:
            params = replace(params, seed=random.getrandbits(63))
        return params

    def build_request(self, prompt, prompt_token_ids, params, request_id=None) -> Request:
        if prompt and prompt_token_ids:
            raise InvalidArgument("give either prompt or prompt_token_ids, not both", "prompt")
        ids = prompt_token_ids or [ord(c) % 100 for c in prompt or ""]
        if not ids:
            raise InvalidArgument("prompt is empty", param="prompt")
        request = Request(request_id or uuid.uuid4().hex, tuple(ids), params)
        self.requests.append(request)
        return request

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        self.messages = messages
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise InvalidArgument("cannot render messages: unknown role", param="messages")
        return [ord(c) % 100 for m in messages for c in f"{m['role']}: {m['content']}\n"]

    async def generate(self, request: Request):
        self.opened += 1
        try:
            if self.refuse is not None:
                raise self.refuse
            params = request.params
            for i in range(params.max_tokens):
                if self.fail_at is not None and self.fail_at[0] == i:
                    raise self.fail_at[1]
                if i == 1 and self.hang_after_first:
                    await asyncio.Event().wait()
                text = f" t{i}"
                if text.strip() in params.stop:
                    yield self._last(request, i, "", "stop")
                    return
                if i == params.max_tokens - 1:
                    last = self._last(request, i + 1, text, self.last_reason or "length")
                    yield replace(last, logprobs=fake_logprobs(params, i + 1))
                    return
                yield GenerationChunk(
                    request.request_id, (i,), text, logprobs=fake_logprobs(params, i)
                )
        finally:
            await asyncio.sleep(0)  # as the real one awaits its KV release: must not be cancelled
            self.closed += 1

    def _last(self, request: Request, n: int, text: str, reason: str) -> GenerationChunk:
        usage = Usage(len(request.prompt_token_ids), n, cached_prompt_tokens=1)
        return GenerationChunk(request.request_id, (n,), text, reason, usage, TIMING)


def fake_logprobs(params: SamplingParams, token: int) -> tuple[TokenLogprobs, ...]:
    """Token i: logprob -i/10, alternatives i+j at -(1+j) for j < params.logprobs."""
    if params.logprobs is None:
        return ()
    top = tuple((token + j, -1.0 - j) for j in range(params.logprobs))
    return (TokenLogprobs(-token / 10, top),)


@pytest.fixture
def fake() -> FakeOrchestrator:
    return FakeOrchestrator()


@pytest.fixture
def app(fake: FakeOrchestrator) -> FastAPI:
    app = FastAPI()
    app.include_router(openai_routes(lambda: fake))
    install_error_handlers(app)
    return app


@pytest.fixture
def client(app: FastAPI, fake: FakeOrchestrator):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    assert fake.closed == fake.opened, "a generation was left open"


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )


def sse_payloads(body: str) -> list[dict | str]:
    """The `data:` payloads of an SSE body, checking the framing; "[DONE]" stays a string."""
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


# -- models and health -------------------------------------------------------------------------


def test_health(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_models_lists_the_checkpoint(client: TestClient, oai: openai.OpenAI) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "pdserve"
    assert [m.id for m in oai.models.list()] == [MODEL]


# -- completions -------------------------------------------------------------------------------


def test_completion(oai: openai.OpenAI, fake: FakeOrchestrator) -> None:
    out = oai.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    [choice] = out.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, " t0 t1 t2", "length")
    assert choice.logprobs is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 3)
    assert out.usage.total_tokens == 8
    assert out.pdserve_timing["prefill_replica"] == "prefill-0"
    assert fake.requests[0].params.greedy


@pytest.mark.parametrize(
    ("fields", "max_tokens"), [({}, 16), ({"max_tokens": None}, SERVER_MAX_TOKENS)]
)
def test_completion_token_limit_defaults(client, fake, fields, max_tokens) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", **fields})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == max_tokens


@pytest.mark.parametrize("model", [MODEL, MODEL_ID, "", None])
def test_model_may_be_its_name_its_id_or_absent(client, model) -> None:
    r = client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize("prompt", [[5, 6, 7], ["abc"], [[5, 6, 7]]])
def test_completion_prompt_forms(client, fake, prompt) -> None:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200
    assert len(fake.requests[0].prompt_token_ids) == 3


def test_completion_sampling_fields_reach_the_orchestrator(client, fake) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 4,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": 11,
        "stop": "t2",
        "stop_token_ids": [3],
        "ignore_eos": True,
        "user": "someone",
        "presence_penalty": 0,  # unknown to pdserve: ignored
    }
    out = client.post("/v1/completions", json=body).json()
    assert out["choices"][0] == {
        "index": 0,
        "text": " t0 t1",
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert fake.requests[0].params == SamplingParams(4, 0.5, 0.9, 7, 11, ("t2",), (3,), True)


def test_completion_stream(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *chunks, done = sse_payloads(r.text)
    assert done == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks] == [" t0", " t1", " t2"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "pdserve_timing" in chunks[-1] and "pdserve_timing" not in chunks[0]
    assert len({c["id"] for c in chunks}) == 1


def test_completion_stream_with_usage_by_the_client(oai: openai.OpenAI) -> None:
    stream = oai.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == " t0 t1 t2"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 3)


def test_completion_logprobs(oai: openai.OpenAI, fake: FakeOrchestrator) -> None:
    out = oai.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=2)
    assert fake.requests[-1].params.logprobs == 2
    lp = out.choices[0].logprobs
    assert lp.tokens == [" t0", " t1", " t3"]  # the double's last token id is 3
    assert lp.token_logprobs == pytest.approx([0.0, -0.1, -0.3])
    assert lp.top_logprobs == [
        {" t0": -1.0, " t1": -2.0},
        {" t1": -1.0, " t2": -2.0},
        {" t3": -1.0, " t4": -2.0},
    ]
    assert lp.text_offset == [0, 3, 6]


def test_completion_stream_logprobs_continue_their_offsets(client: TestClient) -> None:
    body = {**COMPLETION, "max_tokens": 3, "logprobs": 0, "stream": True}
    events = sse_payloads(client.post("/v1/completions", json=body).text)[:-1]
    lps = [e["choices"][0]["logprobs"] for e in events]
    assert [lp["tokens"] for lp in lps] == [[" t0"], [" t1"], [" t3"]]
    assert [lp["text_offset"] for lp in lps] == [[0], [3], [6]]
    assert all(lp["top_logprobs"] == [{}] for lp in lps)


# -- chat --------------------------------------------------------------------------------------


def test_chat(oai: openai.OpenAI, fake: FakeOrchestrator) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        max_completion_tokens=2,
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == " t0 t1"
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 2 and out.usage.prompt_tokens_details.cached_tokens == 1
    assert out.pdserve_timing["decode_replica"] == "decode-0"
    assert fake.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        ({}, SERVER_MAX_TOKENS),
        ({"max_tokens": 3}, 3),
        ({"max_tokens": 3, "max_completion_tokens": 2}, 2),
    ],
)
def test_chat_token_limit(client, fields, max_tokens) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_chat_stream_by_the_client(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    tokens = [[c.token for c in k.choices[0].logprobs.content] for k in chunks[:-1]]
    assert tokens == [[" t0"], [" t1"], [" t3"]]  # each chunk scores its own token
    assert all(not c.top_logprobs for k in chunks[:-1] for c in k.choices[0].logprobs.content)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == " t0 t1 t2"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_chat_stream_single_chunk(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
    [chunk, done] = sse_payloads(client.post("/v1/chat/completions", json=body).text)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": " t0"}
    assert chunk["choices"][0]["finish_reason"] == "length" and "usage" not in chunk
    assert done == "[DONE]"


def test_chat_logprobs(oai: openai.OpenAI, fake: FakeOrchestrator) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
    )
    assert fake.requests[-1].params.logprobs == 1
    content = out.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [(" t0", 0.0), (" t2", -0.2)]
    assert content[0].bytes == list(b" t0")
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(" t0", -1.0)],
        [(" t2", -1.0)],
    ]


def test_chat_without_logprobs_has_none(oai: openai.OpenAI, fake: FakeOrchestrator) -> None:
    out = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=False
    )
    assert fake.requests[-1].params.logprobs is None
    assert out.choices[0].logprobs is None


# -- errors ------------------------------------------------------------------------------------

COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(r, status: int, type_: str, param: str | None = None, code=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {**COMPLETION, "n": 2}, "n", "n=1"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, "prompt", "batched"),
        ("/v1/completions", {**COMPLETION, "prompt": [[1], [2]]}, "prompt", "batched"),
        ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs", "logprobs"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, "logprobs: true"),
        (
            "/v1/chat/completions",
            {**CHAT, "logprobs": True, "top_logprobs": 30},
            "logprobs",
            "logprobs",
        ),
        ("/v1/completions", {**COMPLETION, "echo": True}, "echo", "echo"),
        ("/v1/completions", {"max_tokens": 2}, "prompt", "required"),
        ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, "max_tokens", "integer"),
        ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens", "positive"),
        ("/v1/completions", {**COMPLETION, "temperature": -1}, "temperature", "temperature"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt", "empty"),
        ("/v1/chat/completions", {**CHAT, "n": 3}, "n", "n=1"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "at least 1"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "image_url",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
            "messages",
            "role",
        ),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_are_400(client, fake, path, body, param, words, stream) -> None:
    r = client.post(path, json={**body, "stream": stream})
    error = assert_error(r, 400, "invalid_request_error", param)
    assert words in error["message"]
    assert fake.opened == 0


def test_invalid_json_is_400(client: TestClient) -> None:
    r = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "invalid JSON" in assert_error(r, 400, "invalid_request_error")["message"]


@pytest.mark.parametrize("prompt", [5, ["a", 1], None])
def test_prompt_of_no_accepted_type_is_400(client: TestClient, prompt) -> None:
    r = client.post("/v1/completions", json={"prompt": prompt})
    error = assert_error(r, 400, "invalid_request_error", "prompt")
    assert error["message"] == "prompt: expected str or list[int] or list[str] or list[list[int]]"


def test_unknown_model_is_404(client: TestClient, oai: openai.OpenAI) -> None:
    r = client.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"})
    error = assert_error(r, 404, "not_found_error", "model", code="model_not_found")
    assert "gpt-9" in error["message"]
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_unknown_route_is_404_in_openai_shape(client: TestClient) -> None:
    assert_error(client.get("/v1/engines"), 404, "not_found_error")


@pytest.mark.parametrize(
    ("refusal", "status", "type_", "client_error"),
    [
        (ResourceExhausted("queue full"), 429, "rate_limit_error", openai.RateLimitError),
        (Unavailable("no replica"), 503, "service_unavailable", openai.InternalServerError),
        (DeadlineExceeded("too slow"), 504, "timeout_error", openai.InternalServerError),
        (
            InvalidArgument("bad", param="stop"),
            400,
            "invalid_request_error",
            openai.BadRequestError,
        ),
        (PdServeError("bug"), 500, "internal_error", openai.InternalServerError),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_refused_requests_get_their_status(
    client, oai, fake, refusal, status, type_, client_error, path, stream
) -> None:
    fake.refuse = refusal
    body = {**(COMPLETION if path == "/v1/completions" else CHAT), "stream": stream}
    error = assert_error(client.post(path, json=body), status, type_, refusal.param)
    assert error["message"] == refusal.message
    assert error["code"] == refusal.grpc_code.lower()
    with pytest.raises(client_error):
        oai.completions.create(model=MODEL, prompt="hi", stream=stream)


@pytest.mark.parametrize("stream", [False, True])
def test_unexpected_errors_are_500_without_details(client, fake, stream) -> None:
    fake.refuse = RuntimeError("secret detail")
    r = client.post("/v1/completions", json={**COMPLETION, "stream": stream})
    error = assert_error(r, 500, "internal_error", code="internal")
    assert "secret" not in r.text and "Traceback" not in r.text
    assert error["message"] == "internal server error"


@pytest.mark.parametrize(
    ("failure", "type_", "message"),
    [
        (Unavailable("decode replica died"), "service_unavailable", "decode replica died"),
        (RuntimeError("secret detail"), "internal_error", "internal error"),
    ],
)
def test_error_after_streaming_started_is_a_last_event(client, fake, failure, type_, message):
    fake.fail_at = (2, failure)
    r = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 5, "stream": True})
    assert r.status_code == 200
    *chunks, error, done = sse_payloads(r.text)
    assert [c["choices"][0]["text"] for c in chunks] == [" t0", " t1"]
    assert error["error"]["type"] == type_ and error["error"]["message"] == message
    assert done == "[DONE]" and "secret" not in r.text


def test_error_after_streaming_started_raises_in_the_client(oai, fake) -> None:
    fake.fail_at = (1, Unavailable("decode replica died"))
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    with pytest.raises(openai.APIError, match="decode replica died"):
        list(stream)


def test_abort_is_a_retryable_503(client: TestClient, fake: FakeOrchestrator) -> None:
    fake.last_reason = "abort"
    assert_error(client.post("/v1/completions", json=COMPLETION), 503, "service_unavailable")
    r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    *_, error, done = sse_payloads(r.text)
    assert error["error"]["type"] == "service_unavailable" and done == "[DONE]"


# -- client disconnect -------------------------------------------------------------------------


def test_disconnect_mid_stream_closes_the_generation(client, fake) -> None:
    fake.hang_after_first = True
    body = {**CHAT, "max_tokens": 10, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        first = next(r.iter_lines())
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == " t0"
    assert fake.opened == 1 and fake.closed == 1


def test_disconnect_reported_by_a_failed_send_closes_the_generation(app, fake) -> None:
    """ASGI 2.4 servers raise OSError from `send` once the client is gone."""
    fake.hang_after_first = True
    request = json.dumps({**COMPLETION, "max_tokens": 10, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("test", 1),
        "server": ("test", 80),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": request, "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and sent:
            raise OSError("client went away")
        sent.append(message)

    async def run() -> int:
        try:
            await app(scope, receive, send)
        except Exception:
            pass  # ClientDisconnect: the server's business
        return fake.closed  # closed by the app itself, not later by garbage collection

    assert asyncio.run(run()) == 1
    assert sent[0]["status"] == 200 and fake.opened == 1
