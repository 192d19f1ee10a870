"""Fuzzing the gRPC contract's conversion of a `GenerateRequest` into a `Request`
(`router/grpc_api.request_from_proto`, through the real orchestrator's tokenizer and checks):
any message is a valid `Request` or refused with INVALID_ARGUMENT (NOT_FOUND for an unknown
model), naming the field; nothing else escapes."""

from __future__ import annotations

import asyncio
import math

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from cluster.errors import InvalidArgument, NotFound
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import Request
from router.grpc_api import request_from_proto
from tests.fuzz.fuzzing import fuzz, mutated, seeds, with_seeds
from tests.fuzz.router_service import ConvertOnly

SERVICE: ConvertOnly | None = None


@pytest.fixture(scope="module", autouse=True)
def service(tokenizer_model_dir):
    global SERVICE
    SERVICE = ConvertOnly(tokenizer_model_dir)
    yield
    SERVICE = None


def convert(msg: pb.GenerateRequest) -> Request | None:
    try:
        request = asyncio.run(request_from_proto(msg, SERVICE))
    except (InvalidArgument, NotFound) as exc:
        assert exc.message and (exc.param or isinstance(exc, InvalidArgument)), exc
        return None
    assert isinstance(request, Request) and request.prompt_token_ids
    p = request.params
    assert p.max_tokens > 0 and math.isfinite(p.temperature) and 0 < p.top_p <= 1
    vocab = SERVICE.model.vocab_size
    assert all(0 <= t < vocab for t in request.prompt_token_ids)
    return request


def test_every_seed_converts():
    for raw in seeds("generate_request"):
        assert convert(pb.GenerateRequest.FromString(raw)) is not None


@fuzz(500)
@with_seeds("generate_request")
@given(st.binary(max_size=200) | mutated(st.sampled_from(seeds("generate_request"))))
def test_any_bytes_as_a_generate_request(raw: bytes):
    try:
        msg = pb.GenerateRequest.FromString(raw)
    except DecodeError:  # gRPC refuses such a message before the handler runs
        return
    convert(msg)


FLOATS = st.floats(width=32) | st.sampled_from((0.0, -0.0, 1e-45, 3e38, -1.0, 2.0, 100.01))
INTS = st.integers(0, (1 << 32) - 1)


@st.composite
def hostile_request(draw) -> pb.GenerateRequest:
    msg = pb.GenerateRequest.FromString(draw(st.sampled_from(seeds("generate_request"))))
    s = msg.sampling
    for _ in range(draw(st.integers(1, 4))):
        field = draw(
            st.sampled_from(
                (
                    "prompt",
                    "ids",
                    "request_id",
                    "model",
                    "max_tokens",
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "penalties",
                    "logprobs",
                    "logit_bias",
                    "stop",
                    "stop_token_ids",
                    "stream_interval",
                    "seed",
                )
            )
        )
        if field == "prompt":
            msg.prompt = draw(st.text(max_size=64))
        elif field == "ids":
            del msg.prompt_token_ids[:]
            msg.prompt_token_ids.extend(draw(st.lists(INTS, max_size=8)))
        elif field in ("request_id", "model"):
            setattr(msg, field, draw(st.text(max_size=40)))
        elif field in ("max_tokens", "top_k", "logprobs"):
            setattr(s, field, draw(INTS))
        elif field in ("temperature", "top_p", "min_p"):
            setattr(s, field, draw(FLOATS))
        elif field == "penalties":
            s.repetition_penalty = draw(FLOATS)
            s.frequency_penalty = draw(FLOATS)
            s.presence_penalty = draw(FLOATS)
        elif field == "logit_bias":
            s.logit_bias[draw(INTS)] = draw(FLOATS)
        elif field == "stop":
            s.stop.extend(draw(st.lists(st.text(max_size=10), max_size=5)))
        elif field == "stop_token_ids":
            s.stop_token_ids.extend(draw(st.lists(INTS, max_size=5)))
        elif field == "stream_interval":
            msg.stream_interval = draw(INTS)
        else:
            s.seed = draw(st.integers(0, (1 << 64) - 1))
    return msg


@fuzz(700)
@given(hostile_request())
def test_hostile_field_values(msg: pb.GenerateRequest):
    convert(msg)
