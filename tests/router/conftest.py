"""Fixtures of the API tests: a `FakeService` behind the OpenAI routes, driven raw
(`client`) and by the official client (`oai`)."""

from __future__ import annotations

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from router.openai_api import install_error_handlers, openai_routes
from router.openai_tokenize import tokenizer_routes
from tests.router.fake_service import FakeService


@pytest.fixture
def fake() -> FakeService:
    return FakeService()


@pytest.fixture
def app(fake: FakeService) -> FastAPI:
    app = FastAPI()
    app.include_router(openai_routes(lambda: fake))
    app.include_router(tokenizer_routes(lambda: fake))
    install_error_handlers(app)
    return app


@pytest.fixture
def client(app: FastAPI, fake: FakeService):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
    assert fake.closed == fake.opened, "a generation was left open"


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )
