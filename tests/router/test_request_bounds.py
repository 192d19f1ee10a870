"""Hostile input at the real `Orchestrator`'s door (no pools: nothing gets past hop 1), with
the tiny checkpoint's real tokenizer, over both APIs: a `request_id` that is not a bounded
printable label, a prompt with a lone surrogate, a 4 MB prompt, a chat of too many messages;
each refused with INVALID_ARGUMENT / 400 naming the field (413 for a body past the limit), the
4 MB prompt at once."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.config import ModelConfig, TransferConfig
from cluster.errors import InvalidArgument
from cluster.model.info import describe_model
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import MAX_REQUEST_ID_BYTES
from cluster.serving.app_config import AppConfig
from router.body_limit import BodyLimit, body_limit_bytes
from router.grpc_api import request_from_proto
from router.openai_api import install_error_handlers, openai_routes
from router.orchestrator import Orchestrator
from router.prompt_tokenizer import MAX_CHAT_MESSAGES
from tests.router.fake_service import assert_error

FOUR_MB = "x" * 4_000_000


@pytest.fixture(scope="module")
def orch(tokenizer_model_dir) -> Orchestrator:
    model = ModelConfig(path=str(tokenizer_model_dir))
    config = AppConfig(model=model, transfer=TransferConfig(secret="5e" * 32))
    return Orchestrator(config, describe_model(model), None, None, None, None)


@pytest.fixture
def client(orch):
    app = FastAPI()
    app.include_router(openai_routes(lambda: orch))
    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=body_limit_bytes(orch.prompts.max_prompt_bytes))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def grpc(orch, **fields):
    return asyncio.run(request_from_proto(pb.GenerateRequest(**fields), orch))


@pytest.mark.parametrize(
    "rid",
    ["r" * (MAX_REQUEST_ID_BYTES + 1), "r" * 10_000, "a\nb", "tab\there", "\x00", "é", "\x7f"],
    ids=["257", "10000", "newline", "tab", "nul", "non-ascii", "del"],
)
def test_a_request_id_that_is_not_a_printable_label_is_refused(orch, rid):
    with pytest.raises(InvalidArgument) as e:
        grpc(orch, request_id=rid, prompt="hi")
    assert e.value.param == "request_id" and "request_id" in e.value.message


def test_a_printable_request_id_of_256_is_accepted(orch):
    rid = "".join(chr(32 + i % 95) for i in range(MAX_REQUEST_ID_BYTES))
    request = grpc(orch, request_id=rid, prompt="hi")
    assert request.label == rid and request.request_id != rid  # a label, never an address


def test_a_greedy_request_may_leave_max_tokens_to_the_server(orch):
    """`vars` of a greedy SamplingParams held its cached `greedy` too: this was INTERNAL
    (gRPC `temperature: 0` without `max_tokens`, or chat without a token limit)."""
    request = grpc(orch, prompt="hi", sampling=pb.SamplingParams(temperature=0.0))
    assert request.params.greedy and request.params.max_tokens == orch.config.default_max_tokens
    chat = asyncio.run(orch.chat_prompt([{"role": "user", "content": "hi"}]))
    params = orch.sampling_params(temperature=0.0)
    request = asyncio.run(orch.build_request(None, chat, params))
    assert request.params.greedy and request.params.max_tokens == orch.config.default_max_tokens


def test_a_tiny_grpc_temperature_is_greedy(orch):
    sampling = pb.SamplingParams(temperature=1e-45, max_tokens=4)  # a float32 denormal
    request = grpc(orch, prompt="hi", sampling=sampling)
    assert request.params.greedy and request.params.seed is None


def test_a_lone_surrogate_is_400_not_500(orch, client):
    r = client.post(
        "/v1/completions",
        content=b'{"prompt": "hi \\ud800 there", "max_tokens": 2}',
        headers={"content-type": "application/json"},
    )
    assert "not valid Unicode" in assert_error(r, 400, "invalid_request_error", "prompt")["message"]
    chat = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
    r = client.post(
        "/v1/chat/completions", content=chat, headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_request_error", "messages")


def test_a_4mb_prompt_is_refused_at_once_on_both_apis(orch, client):
    start = time.perf_counter()
    with pytest.raises(InvalidArgument) as e:
        grpc(orch, prompt=FOUR_MB)
    assert e.value.param == "prompt" and time.perf_counter() - start < 0.5
    start = time.perf_counter()
    r = client.post("/v1/completions", json={"prompt": FOUR_MB, "max_tokens": 2})
    assert_error(r, 413, "invalid_request_error", code="request_too_large")
    assert time.perf_counter() - start < 0.5


def test_a_prompt_past_the_byte_bound_within_the_body_limit_is_400(orch, client):
    prompt = "x" * (orch.prompts.max_prompt_bytes + 1)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert "bytes" in assert_error(r, 400, "invalid_request_error", "prompt")["message"]


def test_too_many_chat_messages_are_400(client):
    messages = [{"role": "user", "content": "hi"}] * (MAX_CHAT_MESSAGES + 1)
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert (
        f"at most {MAX_CHAT_MESSAGES}"
        in assert_error(r, 400, "invalid_request_error", "messages")["message"]
    )


def test_too_many_prompt_token_ids_are_refused_before_a_pass_over_them(orch):
    with pytest.raises(InvalidArgument, match="context is 2048") as e:
        grpc(orch, prompt_token_ids=[1] * 1_000_000)
    assert e.value.param == "prompt"
