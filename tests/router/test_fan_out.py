"""`n > 1` (router/fan_out.py) through the OpenAI routes, against a `GenerationService` double:
choice 0 starts alone and the others after its first chunk (so the prompt's KV is in the prefix
cache for them), seeds seed + i, usage counted once for the prompt, streams with `index`,
`continuous_usage_stats`, and every choice's generation closed however the request ends. The
prefix-cache hit itself is shown on the real cluster (tests/e2e/test_openai_parity.py). Batched
prompts: each gives n choices (index i * n + j), each prompt counted once in usage."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import openai
import pytest

from cluster.errors import ResourceExhausted, Unavailable
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from router.fan_out import MAX_CHOICES, choice_requests, fan_out, total_usage
from router.generation_chunk import GenerationChunk, Usage
from tests.router.fake_service import CHAT, MODEL, FakeService, assert_error, sse_payloads

HI = [{"role": "user", "content": "hi"}]


class _Logged(FakeService):
    """A FakeService that logs each choice's start and first chunk, and can refuse, or fail
    mid-stream, the generation it opens k-th (0-based)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []
        self.generated: list[Request] = []
        self.refuse_choice: int | None = None
        self.fail_choice: int | None = None

    async def generate(self, request: Request):
        k = len(self.generated)
        self.generated.append(request)
        self.log.append(f"start {k}")
        if k == self.refuse_choice:
            self.opened += 1
            self.closed += 1
            raise ResourceExhausted("queue full")
        inner = super().generate(request)
        try:
            async for i, chunk in _enumerate(inner):
                if i == 0:
                    await asyncio.sleep(0.01 * (3 - k))  # later choices answer sooner
                    self.log.append(f"first {k}")
                if i == 1 and k == self.fail_choice:
                    raise Unavailable("decode replica died")
                # each choice's cache hit as the real cluster reports it: 0 for the first
                usage = chunk.usage and replace(chunk.usage, cached_prompt_tokens=16 * (k > 0))
                yield replace(chunk, usage=usage)
        finally:
            await inner.aclose()


async def _enumerate(chunks):
    i = 0
    async for chunk in chunks:
        yield i, chunk
        i += 1


@pytest.fixture
def fake() -> _Logged:
    return _Logged()


def test_choice_requests_have_their_own_ids_and_seeds() -> None:
    request = Request("r0", (1, 2), SamplingParams(temperature=1.0, seed=2**63 - 2), label="x")
    choices = choice_requests(request, 3)
    assert choices[0] is request
    assert len({c.request_id for c in choices}) == 3 and {c.label for c in choices} == {"x"}
    assert [c.params.seed for c in choices] == [2**63 - 2, 2**63 - 1, 0]  # seed + i, wrapped
    greedy = choice_requests(Request("g", (1,), SamplingParams(temperature=0.0)), 2)
    assert [c.params.seed for c in greedy] == [None, None]


def test_total_usage_counts_the_prompt_once() -> None:
    usage = total_usage([Usage(10, 3, 0), Usage(10, 5, 8), Usage(10, 1, 8)])
    assert usage == Usage(prompt_tokens=10, completion_tokens=9, cached_prompt_tokens=8)


def test_completion_n3_starts_the_others_after_the_first_prefill(oai, fake) -> None:
    out = oai.completions.create(
        model=MODEL, prompt="hello", max_tokens=3, n=3, temperature=0.8, seed=7
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.text == " t0 t1 t2" and c.finish_reason == "length" for c in out.choices)
    assert fake.log[:2] == ["start 0", "first 0"]  # choice 0's prompt is cached first
    assert sorted(fake.log[2:4]) == ["start 1", "start 2"]
    assert [r.params.seed for r in fake.generated] == [7, 8, 9]
    assert len({r.request_id for r in fake.generated}) == 3
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 9)
    assert out.usage.total_tokens == 14
    assert out.usage.prompt_tokens_details.cached_tokens == 16


def test_chat_n2_greedy_choices_are_equal(oai, fake) -> None:
    out = oai.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=2, n=2, temperature=0, logprobs=True
    )
    first, second = out.choices
    assert (first.index, second.index) == (0, 1)
    assert first.message.content == second.message.content == " t0 t1"
    assert first.logprobs.content[0].token == second.logprobs.content[0].token == " t0"
    assert [r.params.seed for r in fake.generated] == [None, None]
    assert out.usage.completion_tokens == 4


def test_stream_chunks_carry_the_index_and_usage_ends_it(oai, fake) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=3,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *choices, usage = chunks
    for i in range(3):
        mine = [c.choices[0] for c in choices if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content for c in mine) == " t0 t1 t2"
    assert all(c.usage is None for c in choices)
    assert usage.choices == [] and usage.usage.prompt_tokens == len(
        fake.generated[0].prompt_token_ids
    )
    assert usage.usage.completion_tokens == 9


def test_continuous_usage_stats_puts_each_choices_usage_on_every_chunk(client, fake) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": "hello", "max_tokens": 3, "n": 2, "stream": True, "stream_options": options}
    *chunks, usage, done = sse_payloads(client.post("/v1/completions", json=body).text)
    seen = {0: 0, 1: 0}
    for chunk in chunks:
        i = chunk["choices"][0]["index"]
        seen[i] += 1
        assert chunk["usage"]["prompt_tokens"] == 5
        assert chunk["usage"]["completion_tokens"] == seen[i]  # one token a chunk here
    assert seen == {0: 3, 1: 3}
    assert usage["usage"]["completion_tokens"] == 6 and done == "[DONE]"


def test_continuous_usage_stats_needs_include_usage(client, fake) -> None:
    body = {
        **CHAT,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    *chunks, done = sse_payloads(client.post("/v1/chat/completions", json=body).text)
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_choice_refuses_the_request_and_closes_the_others(client, fake, stream):
    fake.refuse_choice = 1
    body = {"prompt": "hi", "max_tokens": 3, "n": 3, "stream": stream}
    assert_error(client.post("/v1/completions", json=body), 429, "rate_limit_error")
    assert fake.opened == fake.closed  # choice 0 (and any other started) closed too


def test_a_choice_failing_mid_stream_ends_the_stream_with_its_error(client, fake) -> None:
    fake.fail_choice = 2
    body = {"prompt": "hi", "max_tokens": 4, "n": 3, "stream": True}
    *_, error, done = sse_payloads(client.post("/v1/completions", json=body).text)
    assert error["error"]["message"] == "decode replica died" and done == "[DONE]"
    assert fake.opened == fake.closed == 3


def test_disconnect_mid_stream_closes_every_choice(client, fake) -> None:
    fake.hang_after_first = True
    body = {**CHAT, "max_tokens": 10, "n": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        first = next(r.iter_lines())
        assert json.loads(first.removeprefix("data: "))["choices"][0]["delta"]["content"] == " t0"
    assert fake.opened == 3 and fake.closed == 3


def test_a_choice_without_a_finish_reason_fails() -> None:
    async def short(request: Request):
        yield GenerationChunk(request.request_id, (1,), "a")

    async def run():
        requests = choice_requests(Request("r", (1,), SamplingParams()), 2)
        return [item async for item in fan_out(short, requests)]

    with pytest.raises(Exception, match="without a finish reason"):
        asyncio.run(run())


def test_official_client_refuses_n_over_the_bound(oai) -> None:
    with pytest.raises(openai.BadRequestError, match="1..16"):
        oai.completions.create(model=MODEL, prompt="hi", n=MAX_CHOICES + 1)


def test_each_choice_calls_serve_under_an_internal_request_id_of_its_own() -> None:
    """Serve's request router holds one pending call per internal id: choices prefilling at
    once under their request's id would leave one waiting forever."""
    from ray.serve import context

    seen: dict[str, set[str]] = {}

    async def generate(request: Request):
        for i in range(3):
            await asyncio.sleep(0)
            own = context._serve_request_context.get()._internal_request_id
            seen.setdefault(request.request_id, set()).add(own)
            yield GenerationChunk(request.request_id, (i,), "a", "length" if i == 2 else None)

    async def run():
        context._serve_request_context.set(context._RequestContext(_internal_request_id="req"))
        requests = choice_requests(Request("r", (1,), SamplingParams()), 3)
        items = [item async for item in fan_out(generate, requests)]
        return requests, items

    requests, items = asyncio.run(run())
    assert len(items) == 9
    ids = [seen[r.request_id] for r in requests]
    assert all(len(s) == 1 for s in ids)  # one id for every step of a choice
    assert ids[0] == {"req"} and len(set.union(*ids)) == 3


# -- batched prompts ---------------------------------------------------------------------------


def test_total_usage_counts_each_prompt_once() -> None:
    usages = [Usage(10, 3, 0), Usage(10, 5, 8), Usage(4, 1, 0), Usage(4, 2, 0)]
    assert total_usage(usages, 2) == Usage(14, 11, 8)


@pytest.mark.parametrize("prompts", [["ab", "cdef"], [[1, 2], [3, 4, 5, 6]]])
def test_batched_prompts_give_n_choices_each_at_index_i_n_plus_j(oai, fake, prompts) -> None:
    out = oai.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, n=2, temperature=0.8, seed=5
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.text == " t0 t1 t2" for c in out.choices)
    # Each prompt's choice 0 starts at once; the others once both are prefilled.
    assert sorted(fake.log[:2]) == ["start 0", "start 1"]
    assert sorted(fake.log[2:4]) == ["first 0", "first 1"]
    assert [len(r.prompt_token_ids) for r in fake.generated] == [2, 4, 2, 4]
    assert [r.params.seed for r in fake.generated] == [5, 5, 6, 6]  # seed + j per prompt
    assert len({r.request_id for r in fake.generated}) == 4
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 12)
    assert out.usage.prompt_tokens_details.cached_tokens == 16 + 16  # the most, per prompt


def test_batched_prompts_stream_with_each_prompts_usage(client, fake) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": ["ab", "cdef"], "max_tokens": 2, "n": 2, "stream": True}
    *chunks, usage, done = sse_payloads(
        client.post("/v1/completions", json={**body, "stream_options": options}).text
    )
    texts = {i: "" for i in range(4)}
    for chunk in chunks:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        assert chunk["usage"]["prompt_tokens"] == [2, 4][choice["index"] // 2]
    assert texts == {i: " t0 t1" for i in range(4)}
    assert usage["usage"]["prompt_tokens"] == 6 and usage["usage"]["completion_tokens"] == 8
    assert done == "[DONE]" and fake.opened == fake.closed == 4


def test_a_refused_prompt_refuses_the_batch_and_closes_the_others(client, fake) -> None:
    fake.refuse_choice = 1  # prompt 1's choice 0
    body = {"prompt": ["ab", "cd", "ef"], "max_tokens": 3}
    assert_error(client.post("/v1/completions", json=body), 429, "rate_limit_error")
    assert fake.opened == fake.closed
