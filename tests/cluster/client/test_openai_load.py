"""The OpenAI-HTTP load generator against a fake server that streams SSE like pdserve's."""

from __future__ import annotations

import asyncio

import pytest

from cluster.client.openai_load import (
    OpenAITarget,
    chat_text,
    run_openai_workload,
    served_models,
)
from cluster.client.workload import Workload, WorkloadRequest, synthetic_workload
from tests.cluster.client.fake_openai_server import MODEL, REFUSED, TIMING, fake_openai_server


def workload() -> Workload:
    good = synthetic_workload(3, 8, 4, vocab_size=512, seed=1).requests
    return Workload((*good, WorkloadRequest(0.0, (REFUSED, 20), 3)), "3 good, 1 refused")


def test_completions_are_streamed_timed_and_counted():
    with fake_openai_server() as (url, bodies):
        assert asyncio.run(served_models(url))[0].id == MODEL
        records = asyncio.run(run_openai_workload(OpenAITarget(url, MODEL), workload()))
    assert [r.status for r in records] == ["OK"] * 3 + ["HTTP_429"]
    assert "overloaded" in records[3].error and records[3].output_tokens == 0
    for r in records[:3]:
        assert r.output_tokens == 4 and len(r.token_times) == 4 and r.prompt_tokens == 8
        assert 0 < r.ttft_s <= r.e2e_s and len(r.itl_s) == 3 and r.finish_reason == "length"
        assert r.timing.prefill == TIMING["prefill_seconds"] and r.timing.decode_replica == "d1"
    sent = bodies[0]
    assert sent["stream"] and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] and sent["temperature"] == 0.0 and sent["model"] == MODEL
    assert sorted(len(b["prompt"]) for b in bodies) == [2, 8, 8, 8]


def test_chat_sends_words_and_takes_the_servers_token_counts():
    with fake_openai_server() as (url, bodies):
        target = OpenAITarget(url, MODEL, chat=True)
        records = asyncio.run(run_openai_workload(target, workload(), max_concurrency=1))
    assert all(r.ok and r.timing is None for r in records)
    assert [r.output_tokens for r in records] == [4, 4, 4, 3]
    assert records[3].prompt_tokens == 2  # the fake counts words
    texts = [b["messages"][0]["content"] for b in bodies]
    assert chat_text((REFUSED, 20)) in texts


def test_shared_leading_ids_give_shared_leading_words():
    a, b = chat_text((100, 200, 5000)), chat_text((100, 200, 7))
    assert a.split()[:2] == b.split()[:2] and a != b
    assert len({chat_text((t,)) for t in range(16, 9000)}) == 9000 - 16


def test_an_unreachable_server_fails_each_request_not_the_run():
    records = asyncio.run(
        run_openai_workload(OpenAITarget("http://127.0.0.1:1/v1", MODEL), workload(), 2, 5.0)
    )
    assert all(not r.ok and r.status == "ClientConnectorError" for r in records)


def test_no_model_listed_is_an_error():
    with fake_openai_server() as (url, _), pytest.raises(Exception, match="404"):
        asyncio.run(served_models(url.replace("/v1", "/v2")))
