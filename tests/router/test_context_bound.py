"""A request whose prompt and `max_tokens` do not fit the model's context is refused by the real
`Orchestrator` before any worker is touched: INVALID_ARGUMENT over gRPC, an OpenAI-shaped 400
over HTTP, both naming the context and what the request needs. The pools are never called
(there are none here)."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.config import ConfigError, ModelConfig, TransferConfig
from cluster.errors import InvalidArgument
from cluster.model.info import ArchSpec, ModelInfo
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig
from router.grpc_api import request_from_proto
from router.openai_api import install_error_handlers, openai_routes
from router.orchestrator import Orchestrator
from tests.router.fake_service import assert_error

CONTEXT = 128
SERVER_DEFAULT = 16
SERVER_INTERVAL = 3
PROMPT = list(range(1, 101))  # 100 tokens: 28 left for the completion


def from_proto(msg: pb.GenerateRequest, service):
    """`request_from_proto`, run to its end."""
    return asyncio.run(request_from_proto(msg, service))


@pytest.fixture(scope="module")
def orch() -> Orchestrator:
    spec = ArchSpec(
        512, 64, 128, 2, 4, 2, 16, 1e-5, CONTEXT, {}, False, False, False, False, False, None
    )
    info = ModelInfo(spec, None, "m@0", frozenset(), CONTEXT)
    config = AppConfig(
        model=ModelConfig(path="/m"),
        transfer=TransferConfig(secret="5e" * 32),
        default_max_tokens=SERVER_DEFAULT,
        stream_interval=SERVER_INTERVAL,
    )
    return Orchestrator(config, info, None, None, None, None)


@pytest.fixture
def client(orch):
    app = FastAPI()
    app.include_router(openai_routes(lambda: orch))
    install_error_handlers(app)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _grpc(orch, max_tokens: int):
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return from_proto(pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling), orch)


def test_grpc_prompt_plus_max_tokens_equal_to_the_context_is_accepted(orch):
    request = _grpc(orch, CONTEXT - len(PROMPT))
    assert request.params.max_tokens == 28 and len(request.prompt_token_ids) == 100


@pytest.mark.parametrize("max_tokens", [CONTEXT - len(PROMPT) + 1, 2**31 - 1])
def test_grpc_over_the_context_is_invalid_argument_naming_both(orch, max_tokens):
    with pytest.raises(InvalidArgument) as err:
        _grpc(orch, max_tokens)
    assert err.value.grpc_code == "INVALID_ARGUMENT" and err.value.param == "max_tokens"
    message = str(err.value)
    assert f"context is {CONTEXT} tokens" in message
    assert f"(100 in the prompt + {max_tokens} max_tokens)" in message


@pytest.mark.parametrize("max_tokens", [CONTEXT - len(PROMPT) + 1, 2**31 - 1])
@pytest.mark.parametrize("stream", [False, True])
def test_http_over_the_context_is_400_naming_both(client, max_tokens, stream):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    r = client.post("/v1/completions", json=body)
    error = assert_error(r, 400, "invalid_request_error", "max_tokens")
    assert f"context is {CONTEXT} tokens" in error["message"]
    assert f"needs {len(PROMPT) + max_tokens} " in error["message"]


def test_http_a_prompt_that_fills_the_context_is_400_naming_the_prompt(client):
    body = {"model": "m", "prompt": list(range(1, CONTEXT + 1)), "max_tokens": 1}
    error = assert_error(
        client.post("/v1/completions", json=body), 400, "invalid_request_error", "prompt"
    )
    assert f"context is {CONTEXT} tokens" in error["message"]


@pytest.mark.parametrize(("prompt_tokens", "want"), [(10, SERVER_DEFAULT), (120, 8), (127, 1)])
def test_grpc_an_unset_max_tokens_is_the_server_default_fitted_to_the_context(
    orch, prompt_tokens, want
):
    request = from_proto(
        pb.GenerateRequest(prompt_token_ids=list(range(1, prompt_tokens + 1))), orch
    )
    assert request.params.max_tokens == want
    assert type(request.params) is SamplingParams  # the marker never leaves the router


def test_a_requests_stream_interval_is_its_own_or_the_servers(orch):
    """Unset, a gRPC request streams at the server's `stream_interval`; set, at its own;
    0 or past 4,096 it is refused naming the field. The config refuses the same bounds."""
    assert _grpc(orch, 8).stream_interval == SERVER_INTERVAL
    sampling = pb.SamplingParams(max_tokens=8)
    own = pb.GenerateRequest(prompt_token_ids=PROMPT, sampling=sampling, stream_interval=5)
    assert from_proto(own, orch).stream_interval == 5
    for bad in (0, 4097):
        own.stream_interval = bad
        with pytest.raises(InvalidArgument, match="stream_interval") as e:
            from_proto(own, orch)
        assert e.value.param == "stream_interval"
    for bad in (0, 4097):
        with pytest.raises(ConfigError, match="stream_interval"):
            AppConfig(model=ModelConfig(path="/m"), stream_interval=bad)
