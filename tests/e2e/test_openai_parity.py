"""Issue 41's parity points on the real cluster (tests/e2e/conftest.py's apps), with the official
openai client and grpc's own health client: `n = 3` is three choices from one prefill (choices
1 and 2 take the prompt's full blocks from the prefix cache choice 0 filled), greedy choices
equal and seeded ones reproducible; streamed choices carry their index, `continuous_usage_stats`
puts usage on every chunk; `grpc.health.v1.Health/Check` answers SERVING through Serve's gRPC
proxy and on a router's direct endpoint. Every test ends with no KV block used or leased."""

from __future__ import annotations

import random

import grpc
import openai
import pytest
from ray import serve

from cluster.pb.grpc.health.v1 import health_pb2 as health_pb
from cluster.pb.grpc.health.v1 import health_pb2_grpc as health_grpc
from tests.ray_fixtures import app_metadata, wait_for_idle

BLOCK = 16  # small_app_config's block size
POOLS = {"pd": {"prefill", "decode"}, "co": {"colocated"}}


def _client(apps, app: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{apps.http_base}/{app}/v1", api_key="unused", max_retries=0, timeout=60
    )


def _fresh_prompt() -> str:
    """A prompt no other test sent (so choice 0 finds nothing of it cached)."""
    words = ["alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "tango", "zulu"]
    rng = random.Random()
    return " ".join(rng.choice(words) for _ in range(40))


@pytest.mark.slow
@pytest.mark.parametrize("app", ["pd", "co"])
def test_n3_is_three_choices_from_one_prefill(apps, app):
    client = _client(apps, app)
    ask = dict(
        model="",
        prompt=_fresh_prompt(),
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    out = client.completions.create(**ask)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    prompt = out.usage.prompt_tokens
    assert prompt > 2 * BLOCK
    # The prompt counted once; choices 1 and 2 found every full block of it but the one
    # holding its last token (the engine computes at least that one) in choice 0's cache.
    assert out.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // BLOCK * BLOCK
    assert out.usage.completion_tokens == 3 * 6
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1, "seeds seed + i gave equal choices"
    assert [c.text for c in client.completions.create(**ask).choices] == texts  # reproducible
    greedy = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": _fresh_prompt()}],
        max_tokens=5,
        n=2,
        temperature=0,
    )
    first, second = greedy.choices
    assert (first.index, second.index) == (0, 1)
    assert first.message.content == second.message.content
    wait_for_idle(apps, app, POOLS[app])


@pytest.mark.slow
def test_streamed_choices_carry_their_index_and_continuous_usage(apps):
    client = _client(apps, "pd")
    stream = client.chat.completions.create(
        model="",
        messages=[{"role": "user", "content": _fresh_prompt()}],
        max_tokens=5,
        n=2,
        temperature=1.0,
        seed=3,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    *chunks, last = list(stream)
    generated = {0: 0, 1: 0}
    for chunk in chunks:
        [choice] = chunk.choices
        assert chunk.usage is not None and chunk.usage.prompt_tokens == last.usage.prompt_tokens
        assert chunk.usage.completion_tokens >= generated[choice.index]  # never goes back
        generated[choice.index] = chunk.usage.completion_tokens
    assert generated == {0: 5, 1: 5}
    assert last.choices == [] and last.usage.completion_tokens == 10
    wait_for_idle(apps, "pd", POOLS["pd"])


def _check(target: str, metadata=()) -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb.HealthCheckRequest(service="pdserve.v1.Generation")
        return health_grpc.HealthStub(channel).Check(request, metadata=metadata, timeout=30).status


@pytest.mark.slow
@pytest.mark.parametrize("app", ["pd", "co"])
def test_health_check_is_serving_through_the_proxy_and_the_direct_endpoint(apps, app):
    serving = health_pb.HealthCheckResponse.SERVING
    assert _check(apps.grpc_target, app_metadata(app)) == serving
    direct = serve.get_deployment_handle("Router", app_name=app).grpc_endpoint.remote().result()
    assert _check(direct) == serving
