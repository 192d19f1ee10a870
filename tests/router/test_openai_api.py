"""The OpenAI HTTP API's answers, against a `GenerationService` double (tests/router/
fake_service.py), driven raw and by the official client: shapes, streaming and logprobs of
completions and chat. The real end-to-end path is tested with the cluster (tests/e2e)."""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest
from fastapi.testclient import TestClient

from cluster.sampling_params import SamplingParams
from tests.router.fake_service import (
    COMPLETION,
    MODEL,
    MODEL_ID,
    SERVER_MAX_TOKENS,
    FakeService,
    sse_payloads,
)

# -- models and health -------------------------------------------------------------------------


def test_health(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_models_lists_the_checkpoint(client: TestClient, oai: openai.OpenAI) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "pdserve"
    assert [m.id for m in oai.models.list()] == [MODEL]
    assert "sampling_defaults" not in card  # none: --generation-config vllm, or none in it


def test_models_show_the_generation_config_defaults(client, fake) -> None:
    defaults = (("temperature", 0.6), ("top_p", 0.95), ("top_k", 20.0))
    fake.model = replace(fake.model, sampling_defaults=defaults)
    [card] = client.get("/v1/models").json()["data"]
    assert card["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0}
    one = client.get(f"/v1/models/{MODEL}").json()
    assert one["sampling_defaults"] == card["sampling_defaults"]


# -- completions -------------------------------------------------------------------------------


def test_completion(oai: openai.OpenAI, fake: FakeService) -> None:
    out = oai.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL
    [choice] = out.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, " t0 t1 t2", "length")
    assert choice.logprobs is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 3)
    assert out.usage.total_tokens == 8
    assert out.pdserve_timing["prefill_replica"] == "prefill-0"
    assert fake.requests[0].params.greedy


@pytest.mark.parametrize(
    ("fields", "max_tokens"), [({}, 16), ({"max_tokens": None}, SERVER_MAX_TOKENS)]
)
def test_completion_token_limit_defaults(client, fake, fields, max_tokens) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", **fields})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == max_tokens


@pytest.mark.parametrize("model", [MODEL, MODEL_ID, "", None])
def test_model_may_be_its_name_its_id_or_absent(client, model) -> None:
    r = client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == MODEL


@pytest.mark.parametrize("prompt", [[5, 6, 7], ["abc"], [[5, 6, 7]]])
def test_completion_prompt_forms(client, fake, prompt) -> None:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 200
    assert len(fake.requests[0].prompt_token_ids) == 3


def test_completion_sampling_fields_reach_the_orchestrator(client, fake) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 4,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": 11,
        "stop": "t2",
        "stop_token_ids": [3],
        "ignore_eos": True,
        "user": "someone",
        "presence_penalty": 0,  # unknown to pdserve: ignored
    }
    out = client.post("/v1/completions", json=body).json()
    assert out["choices"][0] == {
        "index": 0,
        "text": " t0 t1",
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert fake.requests[0].params == SamplingParams(4, 0.5, 0.9, 7, 11, ("t2",), (3,), True)


def test_completion_stream(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    *chunks, done = sse_payloads(r.text)
    assert done == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks] == [" t0", " t1", " t2"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "pdserve_timing" in chunks[-1] and "pdserve_timing" not in chunks[0]
    assert len({c["id"] for c in chunks}) == 1


def test_completion_stream_with_usage_by_the_client(oai: openai.OpenAI) -> None:
    stream = oai.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks[:-1]) == " t0 t1 t2"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 3)


def test_completion_logprobs(oai: openai.OpenAI, fake: FakeService) -> None:
    out = oai.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=2)
    assert fake.requests[-1].params.logprobs == 2
    lp = out.choices[0].logprobs
    assert lp.tokens == [" t0", " t1", " t3"]  # the double's last token id is 3
    assert lp.token_logprobs == pytest.approx([0.0, -0.1, -0.3])
    assert lp.top_logprobs == [
        {" t0": -1.0, " t1": -2.0},
        {" t1": -1.0, " t2": -2.0},
        {" t3": -1.0, " t4": -2.0},
    ]
    assert lp.text_offset == [0, 3, 6]


def test_completion_stream_logprobs_continue_their_offsets(client: TestClient) -> None:
    body = {**COMPLETION, "max_tokens": 3, "logprobs": 0, "stream": True}
    events = sse_payloads(client.post("/v1/completions", json=body).text)[:-1]
    lps = [e["choices"][0]["logprobs"] for e in events]
    assert [lp["tokens"] for lp in lps] == [[" t0"], [" t1"], [" t3"]]
    assert [lp["text_offset"] for lp in lps] == [[0], [3], [6]]
    assert all(lp["top_logprobs"] == [{}] for lp in lps)


# -- chat --------------------------------------------------------------------------------------


def test_chat(oai: openai.OpenAI, fake: FakeService) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        max_completion_tokens=2,
    )
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    [choice] = out.choices
    assert choice.message.role == "assistant" and choice.message.content == " t0 t1"
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 2 and out.usage.prompt_tokens_details.cached_tokens == 1
    assert out.pdserve_timing["decode_replica"] == "decode-0"
    assert fake.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize(
    ("fields", "max_tokens"),
    [
        ({}, SERVER_MAX_TOKENS),
        ({"max_tokens": 3}, 3),
        ({"max_tokens": 3, "max_completion_tokens": 2}, 2),
    ],
)
def test_chat_token_limit(client, fields, max_tokens) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_chat_stream_by_the_client(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    tokens = [[c.token for c in k.choices[0].logprobs.content] for k in chunks[:-1]]
    assert tokens == [[" t0"], [" t1"], [" t3"]]  # each chunk scores its own token
    assert all(not c.top_logprobs for k in chunks[:-1] for c in k.choices[0].logprobs.content)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content for c in chunks[:-1]) == " t0 t1 t2"
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, None, "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_chat_stream_single_chunk(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}
    [chunk, done] = sse_payloads(client.post("/v1/chat/completions", json=body).text)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": " t0"}
    assert chunk["choices"][0]["finish_reason"] == "length" and "usage" not in chunk
    assert done == "[DONE]"


def test_chat_logprobs(oai: openai.OpenAI, fake: FakeService) -> None:
    out = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=1,
    )
    assert fake.requests[-1].params.logprobs == 1
    content = out.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [(" t0", 0.0), (" t2", -0.2)]
    assert content[0].bytes == list(b" t0")
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(" t0", -1.0)],
        [(" t2", -1.0)],
    ]


def test_chat_without_logprobs_has_none(oai: openai.OpenAI, fake: FakeService) -> None:
    out = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=False
    )
    assert fake.requests[-1].params.logprobs is None
    assert out.choices[0].logprobs is None
