"""Per-token logprobs from the engine against transformers' own logits."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.errors import InvalidArgument
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import greedy, prompt, run_to_completion
from tests.engine_kv import export_kv, import_kv

ARCH = "qwen2"
N = 6


def assert_matches_hf(logprobs, hf_logits, tokens, k) -> None:
    """Each token's logprob and its k alternatives agree with log_softmax of HF's logits."""
    assert len(logprobs) == len(tokens) == len(hf_logits)
    for lp, token, logits in zip(logprobs, tokens, hf_logits, strict=True):
        want = torch.log_softmax(logits, dim=-1)
        assert lp.logprob == pytest.approx(float(want[token]), abs=1e-4)
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for tid, v in lp.top:
            assert v == pytest.approx(float(want[tid]), abs=1e-4)
        if k:  # greedy: the sampled token is the most likely one
            assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-6)
            assert {t for t, _ in lp.top} == set(torch.topk(want, k).indices.tolist())


def test_greedy_logprobs_match_transformers(model_dir, make_engine, hf):
    path = model_dir(ARCH)
    engine = make_engine(path, block_size=4)
    asks = {"a": 5, "b": None, "c": 0}
    ids = {rid: prompt(7 + 3 * i, seed=30 + i) for i, rid in enumerate(asks)}
    requests = [Request(r, ids[r], greedy(N, logprobs=k)) for r, k in asks.items()]
    outs = run_to_completion(engine, requests)
    for rid, k in asks.items():
        out = outs[rid]
        if k is None:
            assert out.logprobs == []
            continue
        oracle = hf.run(path, ids[rid], N)
        assert out.token_ids == oracle.tokens
        assert_matches_hf(out.logprobs, oracle.logits, out.token_ids, k)


def test_sampled_tokens_report_the_models_own_logprob(model_dir, make_engine):
    """Temperature and top-k change what is drawn, not the reported distribution: a token's
    logprob is the same as a greedy run's alternatives list says for that token."""
    path = model_dir(ARCH)
    engine = make_engine(path)
    ids = prompt(9, seed=40)
    hot = SamplingParams(max_tokens=1, temperature=1.7, top_k=3, seed=5, logprobs=20)
    cold = greedy(1, logprobs=20)
    outs = run_to_completion(engine, [Request("hot", ids, hot), Request("cold", ids, cold)])
    (sampled,), (reference,) = outs["hot"].logprobs, outs["cold"].logprobs
    table = dict(reference.top)
    token = outs["hot"].token_ids[0]
    assert token in table  # top_k = 3 keeps it among the 20 most likely
    assert sampled.logprob == pytest.approx(table[token], abs=1e-5)
    assert sampled.top == reference.top
    assert all(v <= 0 for _, v in reference.top)
    assert sum(math.exp(v) for _, v in reference.top) <= 1.0 + 1e-5


def test_logprobs_survive_the_prefill_to_decode_hop(model_dir, make_engine):
    path = model_dir(ARCH)
    pre = make_engine(path, block_size=4)
    dec = make_engine(path, block_size=4)
    plain = make_engine(path, block_size=4)
    ids = prompt(11, seed=41)
    params = greedy(N, logprobs=3)
    first = pre.add_request(Request("x", ids, params, prefill_only=True))
    assert first is None
    out = {}
    while pre.has_work():
        for o in pre.step():
            out.setdefault(o.request_id, []).extend(o.logprobs)
    kv = export_kv(pre, "x")
    import_kv(dec, Request("x", ids, params), kv, pre.seqs["x"].token_ids[-1])
    while dec.has_work():
        for o in dec.step():
            out["x"].extend(o.logprobs)
    assert pre.release("x")
    want = run_to_completion(plain, [Request("x", ids, params)])["x"].logprobs
    assert len(out["x"]) == N
    for got, ref in zip(out["x"], want, strict=True):
        assert got.logprob == pytest.approx(ref.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in ref.top]


@pytest.mark.parametrize("bad", [-1, 21])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(InvalidArgument, match="logprobs"):
        SamplingParams(logprobs=bad)
