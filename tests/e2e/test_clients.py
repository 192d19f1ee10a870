"""The public surfaces end to end, on the session's apps: the official `openai` client, logprobs
over both APIs against transformers, `GetModelInfo`, and the `pdserve` CLI's client verbs."""

from __future__ import annotations

import openai
import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.e2e.conftest import PD
from tests.e2e.grpc_calls import generate, greedy_sampling, tokens
from tests.ray_fixtures import app_metadata, stub, wait_for_idle


def test_openai_client_completions_and_chat(apps, tokenizer_model_dir, hf):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_model_dir)
    client = openai.OpenAI(base_url=f"{apps.http_base}/pd/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    extra = {"ignore_eos": True}

    prompt = "The quick brown fox"
    ids = tok.encode(prompt, add_special_tokens=False)
    want = tok.decode(hf.greedy(tokenizer_model_dir, ids, 12), skip_special_tokens=True)
    done = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
    )
    assert done.choices[0].text == want
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 12)
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=extra
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == want

    messages = [{"role": "user", "content": "Say hello"}]
    chat_ids = tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )
    want = tok.decode(hf.greedy(tokenizer_model_dir, chat_ids, 10), skip_special_tokens=True)
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, extra_body=extra
    )
    assert chat.choices[0].message.content == want
    assert chat.usage.prompt_tokens == len(chat_ids)
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 10
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_logprobs_over_grpc_and_openai_match_transformers(apps, tokenizer_model_dir, hf):
    """Disaggregated: the prefill worker scores the first token, the decode worker the rest;
    every logprob is log_softmax of transformers' logits, over gRPC and over the OpenAI API."""
    import torch

    ids = list(range(30, 52))
    n, k = 6, 3
    sampling = greedy_sampling(n)
    sampling.logprobs = k
    msgs, _ = generate(apps, PD, prompt_token_ids=ids, sampling=sampling)
    oracle = hf.run(tokenizer_model_dir, ids, n)
    assert tokens(msgs) == oracle.tokens
    scored = [lp for m in msgs for lp in m.logprobs]
    assert len(scored) == n
    for lp, token, logits in zip(scored, oracle.tokens, oracle.logits, strict=True):
        want = torch.log_softmax(logits, dim=-1)
        assert lp.logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert [t.token_id for t in lp.top_logprobs] == torch.topk(want, k).indices.tolist()
    client = openai.OpenAI(base_url=f"{apps.http_base}/pd/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=ids,
        max_tokens=n,
        temperature=0,
        logprobs=k,
        extra_body={"ignore_eos": True},
    )
    got = out.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in scored], abs=1e-6)
    assert [len(t) for t in got.top_logprobs] == [k] * n
    wait_for_idle(apps, PD, {"prefill", "decode"})


def test_model_info(apps):
    info = stub(apps).GetModelInfo(pb.GetModelInfoRequest(), metadata=app_metadata(PD))
    assert info.vocab_size == 4096 and info.block_size == 16 and info.mode == "disaggregated"
    assert info.max_context_length == 2048 and info.model_id.startswith("tiny@")


def test_cli_generate_and_status_against_the_cluster(apps, capsys):
    import json

    from cluster.cli.main import main

    target = ["--target", apps.grpc_target, "--application", PD]
    ids = "5,6,7,8"
    assert main(["generate", *target, "--json", "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--prompt-token-ids", ids]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    msgs, _ = generate(apps, PD, prompt_token_ids=[5, 6, 7, 8], sampling=greedy_sampling(6))
    assert out["token_ids"] == tokens(msgs) and out["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 6 and out["timing"]["prefill_replica"]
    assert main(["generate", *target, "--json", "--max-tokens", "3", "--temperature", "0",
                 "--ignore-eos", "--prompt-token-ids", ids, "--logprobs", "2"]) == 0  # fmt: skip
    scored = json.loads(capsys.readouterr().out)["logprobs"]
    assert [s["token_id"] for s in scored] == tokens(msgs)[:3]
    assert all(s["top_logprobs"][0]["token_id"] == s["token_id"] for s in scored)
    wait_for_idle(apps, PD, {"prefill", "decode"})
    assert main(["status", *target]) == 0
    table = capsys.readouterr().out
    for word in ("prefill", "decode", "Prefill", "Decode", "kv used", "kv cached", "generated"):
        assert word in table
    assert main(["generate", *target, "--prompt-token-ids", "999999"]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
