"""The OpenAI HTTP API's errors, against a `GenerationService` double: bad requests, refusals
and failures get OpenAI-shaped errors with their documented statuses, and every generation the
API opens is closed, the client's disconnect included."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from fastapi.testclient import TestClient

from cluster.errors import (
    DeadlineExceeded,
    InvalidArgument,
    PdServeError,
    ResourceExhausted,
    Unavailable,
)
from tests.router.fake_service import (
    CHAT,
    COMPLETION,
    MODEL,
    FakeService,
    assert_error,
    sse_payloads,
)

# -- bad requests ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {**COMPLETION, "n": 17}, "n", "1..16"),
        ("/v1/completions", {**COMPLETION, "n": 0}, "n", "1..16"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a"] * 17}, "prompt", "at most 16"),
        ("/v1/completions", {**COMPLETION, "prompt": [[1]] * 17}, "prompt", "at most 16"),
        ("/v1/completions", {**COMPLETION, "prompt": ["a", ""]}, "prompt", "empty"),
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
        ("/v1/completions", {**COMPLETION, "stop": ["x"] * 65}, "stop", "at most 64"),
        ("/v1/completions", {**COMPLETION, "prompt": ""}, "prompt", "empty"),
        ("/v1/chat/completions", {**CHAT, "n": 99}, "n", "1..16"),
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


def test_abort_is_a_retryable_503(client: TestClient, fake: FakeService) -> None:
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
