"""The logit adjustments end to end, on the session's apps (tests/e2e/conftest.py): greedy
decoding under logit_bias, repetition, frequency and presence penalties through router,
prefill, KV transfer and decode (and the colocated app) equals the reference computation on
the same checkpoint (tests/penalty_oracle.py); bad and unimplemented fields are refused by the
real router over gRPC and HTTP."""

from __future__ import annotations

import grpc
import openai
import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.sampling_params import SamplingParams
from tests.e2e.conftest import CO, PD
from tests.e2e.grpc_calls import generate, greedy_sampling, tokens
from tests.penalty_oracle import assert_same_greedy, reference_greedy

N = 24
PROMPT = [101, 2047, 33, 870, 101, 515, 3071, 33, 1999, 64, 870, 12]


@pytest.mark.parametrize("app", [PD, CO])
def test_greedy_with_every_adjustment_equals_the_reference(apps, tokenizer_model_dir, hf, app):
    plain = hf.greedy(tokenizer_model_dir, PROMPT, N)
    bias = {plain[0]: -5.0, plain[3]: -2.0, 4000: 3.0}
    params = SamplingParams(
        max_tokens=N,
        temperature=0.0,
        ignore_eos=True,
        logit_bias=bias,
        repetition_penalty=1.25,  # exact in float32, as the proto carries it
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    want = reference_greedy(hf.model(tokenizer_model_dir), PROMPT, N, params)
    sampling = greedy_sampling(N)
    sampling.repetition_penalty = params.repetition_penalty
    sampling.frequency_penalty = params.frequency_penalty
    sampling.presence_penalty = params.presence_penalty
    for token, value in params.logit_bias:
        sampling.logit_bias[token] = value
    msgs, _ = generate(apps, app, prompt_token_ids=PROMPT, sampling=sampling)
    got = tokens(msgs)
    assert_same_greedy(got, want)
    assert got != plain
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_an_out_of_vocabulary_bias_is_invalid_argument(apps):
    sampling = greedy_sampling(4)
    sampling.logit_bias[4096] = 1.0  # the tiny checkpoint's vocabulary is 4096 tokens
    with pytest.raises(grpc.RpcError) as e:
        generate(apps, PD, prompt_token_ids=PROMPT, sampling=sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "logit_bias" in e.value.details()


def test_http_refuses_what_is_not_implemented_and_serves_the_rest(apps):
    client = openai.OpenAI(base_url=f"{apps.http_base}/pd/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"use_beam_search": True},
        )
    assert e.value.body["param"] == "use_beam_search"
    out = client.completions.create(
        model="",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        presence_penalty=1.0,
        logit_bias={str(PROMPT[0]): -100},
        extra_body={"repetition_penalty": 1.2, "ignore_eos": True},
    )
    assert out.usage.completion_tokens == 4
