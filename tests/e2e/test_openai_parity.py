"""Issue 41's parity points on the real cluster (tests/e2e/conftest.py's apps), with the official
openai client and grpc's own health client: `n = 3` is three choices from one prefill (choices
1 and 2 take the prompt's full blocks from the prefix cache choice 0 filled), greedy choices
equal and seeded ones reproducible; streamed choices carry their index, `continuous_usage_stats`
puts usage on every chunk; `grpc.health.v1.Health/Check` answers SERVING through Serve's gRPC
proxy and on a router's direct endpoint; on an app of its own with `--reasoning-parser
deepseek_r1` and a `--chat-template` whose generation prompt opens `<think>`, a greedy answer is
split into `reasoning_content` and `content`, whole and streamed, as the parser splits the
same request's text without one (a completion of the same prompt, batched with a second
prompt). Every test ends with no KV block used or leased."""

from __future__ import annotations

import random

import grpc
import openai
import pytest
import requests
from ray import serve
from transformers import AutoTokenizer

from cluster.pb.grpc.health.v1 import health_pb2 as health_pb
from cluster.pb.grpc.health.v1 import health_pb2_grpc as health_grpc
from router.chat.reasoning_parser import REASONING_PARSERS
from tests.ray_fixtures import app_metadata, deploy, small_app_config, wait_for_idle

BLOCK = 16  # small_app_config's block size
POOLS = {"pd": {"prefill", "decode"}, "co": {"colocated"}}


THINK = "think"  # the app with a reasoning parser
# A generation prompt that opens the reasoning: a random-weight model's answer is all reasoning
# (unless it happens to write "</think>").
THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}"
)


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


@pytest.fixture(scope="module")
def thinking_app(ray_serve, tokenizer_model_dir):
    config = small_app_config(
        str(tokenizer_model_dir),
        mode="colocated",
        reasoning_parser="deepseek_r1",
        chat_template=THINK_TEMPLATE,
    )
    deploy(config, THINK, f"/{THINK}")
    yield ray_serve
    serve.delete(THINK)


@pytest.mark.slow
def test_reasoning_is_split_on_a_template_that_opens_think(thinking_app, tokenizer_model_dir):
    client = _client(thinking_app, THINK)
    messages = [{"role": "user", "content": "why is the sky blue?"}]
    r = requests.post(
        f"{thinking_app.http_base}/{THINK}/tokenize", json={"messages": messages}, timeout=30
    )
    ids = r.json()["tokens"]
    rendered = "<|user|>why is the sky blue?\n<|assistant|><think>\n"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_model_dir)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)  # the server's template
    greedy = dict(model="", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    # The same greedy request without a parser (completions read no reasoning), batched.
    batch = client.completions.create(prompt=[ids, ids[:-2]], **greedy)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == 2 * len(ids) - 2
    alone = client.completions.create(prompt=ids[:-2], **greedy).choices[0].text
    assert batch.choices[1].text == alone
    text = batch.choices[0].text
    reasoning, content = REASONING_PARSERS["deepseek_r1"].parse(text)
    assert reasoning and reasoning + (content or "") == text
    message = client.chat.completions.create(messages=messages, **greedy).choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content or "")
    streamed = ["", ""]
    for chunk in client.chat.completions.create(messages=messages, stream=True, **greedy):
        for choice in chunk.choices:
            streamed[0] += getattr(choice.delta, "reasoning_content", None) or ""
            streamed[1] += choice.delta.content or ""
    assert streamed == [reasoning, content or ""]
    wait_for_idle(thinking_app, THINK, POOLS["co"])
