"""Logit bias, repetition, frequency and presence penalties and min-p equal their oracles
(tests/penalty_oracle.py: transformers' `generate` with its logits processors, or a reference
loop where transformers has none) in a colocated engine, across a prefill -> decode hand-off,
chunked and batched with plain requests; plain rows stay on the plain path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cluster.engine.sampler import Sampler, filtered_probs
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import disaggregated, greedy, prompt, run_to_completion
from tests.penalty_oracle import assert_same_greedy, hf_generate, reference_greedy

N = 20
PROMPT = prompt(23, seed=11)


@pytest.fixture
def path(model_dir):
    return model_dir("llama-gqa")


def _bias(hf, path) -> dict[int, float]:
    """A bias that changes the greedy output: against its first and third tokens, and for a
    token it does not pick."""
    plain = hf.greedy(path, PROMPT, N)
    unpicked = next(t for t in range(512) if t not in plain)
    return {plain[0]: -4.0, plain[2]: -2.5, unpicked: 3.0}


def _alone(make_engine, path, params: SamplingParams, ids=PROMPT) -> list[int]:
    engine = make_engine(path, block_size=4)
    return run_to_completion(engine, [Request("r", ids, params)])["r"].token_ids


def test_logit_bias_equals_transformers_sequence_bias(make_engine, path, hf):
    params = greedy(N, logit_bias=_bias(hf, path))
    got = _alone(make_engine, path, params)
    assert_same_greedy(got, hf_generate(hf.model(path), PROMPT, N, params))
    assert got != hf.greedy(path, PROMPT, N)


@pytest.mark.parametrize("penalty", [1.8, 0.5])
def test_repetition_penalty_equals_transformers(make_engine, path, hf, penalty):
    params = greedy(N, repetition_penalty=penalty)
    got = _alone(make_engine, path, params)
    assert_same_greedy(got, hf_generate(hf.model(path), PROMPT, N, params))
    assert got != hf.greedy(path, PROMPT, N)


@pytest.mark.parametrize(
    ("frequency", "presence"), [(1.5, 0.0), (0.0, 2.0), (-2.0, 0.0), (0.0, -2.0), (0.7, -0.4)]
)
def test_frequency_and_presence_penalties_equal_the_reference(
    make_engine, path, hf, frequency, presence
):
    params = greedy(N, frequency_penalty=frequency, presence_penalty=presence)
    got = _alone(make_engine, path, params)
    assert_same_greedy(got, reference_greedy(hf.model(path), PROMPT, N, params))
    assert got != hf.greedy(path, PROMPT, N)


def test_reference_loop_equals_transformers_generate(path, hf):
    """The reference loop (the oracle of frequency and presence) agrees with `generate`."""
    params = greedy(N, logit_bias=_bias(hf, path), repetition_penalty=1.3)
    model = hf.model(path)
    assert (
        reference_greedy(model, PROMPT, N, params).tokens
        == hf_generate(model, PROMPT, N, params).tokens
    )


def _all_four(hf, path, max_tokens=N) -> SamplingParams:
    return greedy(
        max_tokens,
        logit_bias=_bias(hf, path),
        repetition_penalty=1.4,
        frequency_penalty=0.6,
        presence_penalty=0.3,
    )


def test_all_adjustments_across_the_prefill_decode_hand_off(make_engine, path, hf):
    params = _all_four(hf, path)
    want = reference_greedy(hf.model(path), PROMPT, N, params)
    prefill, decode = make_engine(path, block_size=4), make_engine(path, block_size=4)
    decode.add_request(Request("busy", prompt(9, seed=2), greedy(30)))  # decode is busy
    decode.step()
    assert_same_greedy(disaggregated(prefill, decode, "r", PROMPT, params), want)


def test_penalised_and_plain_requests_batched_and_chunked(make_engine, path, hf):
    penalised = _all_four(hf, path)
    cases = [
        Request("all", PROMPT, penalised),
        Request("plain", prompt(17, seed=3), greedy(N)),
        Request("rep", prompt(31, seed=4), greedy(N, repetition_penalty=1.6)),
        Request("plain2", PROMPT, greedy(N)),
    ]
    engine = make_engine(path, block_size=4, max_num_batched_tokens=16)  # prompts chunked
    outs = run_to_completion(engine, cases)
    model = hf.model(path)
    for r in cases:
        want = reference_greedy(model, r.prompt_token_ids, N, r.params)
        assert_same_greedy(outs[r.request_id].token_ids, want)
    for r in cases[1::2]:
        hf.assert_greedy(path, r.prompt_token_ids, outs[r.request_id].token_ids, N)


# -- min-p ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 0, 1.0, 0.1), (0.7, 0, 1.0, 0.05), (1.3, 40, 1.0, 0.2), (0.9, 0, 0.8, 0.3)],
)
def test_filters_equal_transformers_warpers(temperature, top_k, top_p, min_p):
    """What a sampled row may draw, and with which probability, equals transformers'
    Temperature, TopK, TopP and MinP warpers applied in `generate`'s order."""
    logits = torch.randn(16, 512, generator=torch.Generator().manual_seed(5)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    warpers.append(MinPLogitsWarper(min_p))
    want = torch.softmax(warpers(torch.zeros(16, 1, dtype=torch.long), logits.clone()), -1)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = filtered_probs(logits, [p] * len(logits))
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got / got.sum(-1, keepdim=True), want, atol=1e-6)
    without = filtered_probs(logits, [dataclasses.replace(p, min_p=0.0)] * len(logits))
    assert (without > 0).sum() > (got > 0).sum()  # min-p removed tokens


def test_min_p_one_samples_the_argmax_in_both_pools(make_engine, path, hf):
    """`min_p = 1` keeps only the most likely token: a seeded draw is greedy decoding."""
    params = SamplingParams(temperature=1.0, min_p=1.0, seed=7, max_tokens=N, ignore_eos=True)
    want = hf.greedy(path, PROMPT, N)
    assert _alone(make_engine, path, params) == want
    prefill, decode = make_engine(path, block_size=4), make_engine(path, block_size=4)
    assert disaggregated(prefill, decode, "r", PROMPT, params) == want
    assert _alone(make_engine, path, dataclasses.replace(params, min_p=0.0)) != want


# -- the sampler ------------------------------------------------------------------------------


def test_sampler_leaves_logits_raw_and_plain_rows_alone():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)) * 3
    raw = logits.clone()
    top = int(raw[1].argmax())
    plain, biased = greedy(1), greedy(1, logit_bias={top: -100.0})
    sampled = SamplingParams(temperature=1.0, repetition_penalty=3.0)
    histories = [[1, 2], [3, top], [top], [5]]
    params, positions = [plain, biased, sampled, plain], [0, 1, 0, 0]
    tokens = Sampler()(logits, params, [1, 2, 3, 4], positions, histories)
    assert torch.equal(logits, raw)  # logprobs read the raw logits
    assert [tokens[0], tokens[3]] == [int(raw[0].argmax()), int(raw[3].argmax())]
    assert tokens[1] == int(raw[1].topk(2).indices[1])
    for row in (1, 2):  # an adjusted row is the same alone as in the batch
        one = slice(row, row + 1)
        alone = Sampler()(logits[one], params[one], [row + 1], positions[one], histories[one])
        assert alone == [tokens[row]]
