"""The OpenAI app's body limit (router/body_limit.py): a body past it is answered 413 with
OpenAI's error JSON, whether its Content-Length says so or it comes chunked; a body within it
is served; the generation is never opened."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from router.body_limit import MAX_OTHER_BYTES, BodyLimit, body_limit_bytes
from router.openai_api import install_error_handlers, openai_routes
from tests.router.fake_service import COMPLETION, FakeService, assert_error

LIMIT = 4096


@pytest.fixture
def fake() -> FakeService:
    return FakeService()


@pytest.fixture
def client(fake):
    app = FastAPI()
    app.include_router(openai_routes(lambda: fake))
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=LIMIT)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def body(n_bytes: int) -> bytes:
    """A completion request body of exactly `n_bytes`."""
    empty = json.dumps({**COMPLETION, "prompt": ""}).encode()
    return json.dumps({**COMPLETION, "prompt": "x" * (n_bytes - len(empty))}).encode()


def chunks(data: bytes, size: int = 1000):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def post(client, data, **headers):
    headers = {"content-type": "application/json", **headers}
    return client.post("/v1/completions", content=data, headers=headers)


def test_a_body_at_the_limit_is_served(client, fake):
    assert len(body(LIMIT)) == LIMIT
    assert post(client, body(LIMIT)).status_code == 200
    assert fake.opened == 1


def test_a_declared_length_past_the_limit_is_413(client, fake):
    error = assert_error(post(client, body(LIMIT + 1)), 413, "invalid_request_error")
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]
    assert fake.opened == 0 and not fake.requests


def test_a_chunked_body_past_the_limit_is_413(client, fake):
    r = post(client, chunks(body(4 * LIMIT)))  # no Content-Length: counted as it arrives
    error = assert_error(r, 413, "invalid_request_error")
    assert error["code"] == "request_too_large"
    assert fake.opened == 0
    assert post(client, chunks(body(LIMIT))).status_code == 200


def test_the_limit_follows_the_context():
    assert body_limit_bytes(2048 * 16) == 3 * 2048 * 16 + MAX_OTHER_BYTES
