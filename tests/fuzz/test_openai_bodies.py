"""Fuzzing the OpenAI API's conversion of a request body into a `Request` (router/openai_api.py,
router/openai_protocol.py, through the real orchestrator's tokenizer and checks): any body is
answered 200 with a valid `Request` behind it, or refused with 400 (404 for an unknown model,
413 past the body limit) in OpenAI's error shape; never a 500, never FastAPI's 422."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from router.body_limit import BodyLimit, body_limit_bytes
from router.openai_api import install_error_handlers, openai_routes
from tests.fuzz.fuzzing import fuzz, mutated, seeds, with_seeds
from tests.fuzz.router_service import ConvertOnly

STATE: dict = {}
REFUSED = {400, 404, 413}


@pytest.fixture(scope="module", autouse=True)
def client(tokenizer_model_dir):
    service = ConvertOnly(tokenizer_model_dir)
    app = FastAPI()
    app.include_router(openai_routes(lambda: service))
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=body_limit_bytes(service.prompts.max_prompt_bytes))
    with TestClient(app, raise_server_exceptions=False) as c:
        STATE.update(client=c, service=service)
        yield
    STATE.clear()


def post(path: str, body: bytes) -> int:
    service = STATE["service"]
    before = len(service.requests)
    r = STATE["client"].post(path, content=body, headers={"content-type": "application/json"})
    if r.status_code == 200:
        assert len(service.requests) > before  # one a choice (n, batched prompts)
        vocab = service.model.vocab_size
        for request in service.requests[before:]:
            assert request.prompt_token_ids and request.params.max_tokens > 0
            assert all(0 <= t < vocab for t in request.prompt_token_ids)
    else:
        assert r.status_code in REFUSED, (r.status_code, r.text)
        assert len(service.requests) == before  # refused before any request was built
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return r.status_code


def path_of(seed: bytes) -> str:
    return "/v1/chat/completions" if b'"messages"' in seed else "/v1/completions"


def test_every_seed_is_answered():
    for seed in seeds("openai_"):
        assert post(path_of(seed), seed) == 200


@fuzz(300)
@with_seeds("openai_")
@given(st.binary(max_size=200) | mutated(st.sampled_from(seeds("openai_"))))
def test_any_bytes_as_a_body(body: bytes):
    for path in ("/v1/completions", "/v1/chat/completions"):
        post(path, body)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
FIELDS = (
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
    "top_k", "min_p", "n", "stop", "seed", "stream", "stream_options", "logprobs",
    "top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "response_format", "tools", "tool_choice", "echo", "suffix", "user", "ignore_eos",
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
)  # fmt: skip
SPECIAL = st.sampled_from(
    (
        0, -1, 1 << 31, 1 << 64, 1e308, -0.0, "", "\ud800", "x" * 300, [], {}, [0] * 50,
        [{"role": "user", "content": None}], [{"role": "tool", "content": [{"type": "image"}]}],
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}},
        {"type": "json_object"}, {"type": "regex", "regex": "("},
    )
)  # fmt: skip


@st.composite
def hostile_body(draw) -> tuple[str, bytes]:
    seed = draw(st.sampled_from(seeds("openai_")))
    body = json.loads(seed)
    for _ in range(draw(st.integers(1, 4))):
        field = draw(st.sampled_from(FIELDS))
        if draw(st.integers(0, 4)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw(JSON | SPECIAL)
    text = json.dumps(body, ensure_ascii=draw(st.booleans()), allow_nan=True)
    return path_of(seed), text.encode("utf-8", "surrogatepass")


@fuzz(350)
@given(hostile_body())
def test_hostile_field_values(case: tuple[str, bytes]):
    post(*case)
