"""Greedy output equals transformers `generate` token for token, for every architecture variant,
through batching, chunked prefill, sequences joining a running batch, and preemption."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from cluster.request import Request
from tests.conftest import (
    ARCHS,
    SLIDING_WINDOW,
    drive,
    greedy,
    prompt,
    record_plans,
    run_to_completion,
    step_into,
)

PROMPT_LENS = (3, 17, 40)  # one block, several blocks, and longer than the sliding window
NEW_TOKENS = 24


def _requests() -> list[Request]:
    return [Request(f"r{n}", prompt(n, seed=n), greedy(NEW_TOKENS)) for n in PROMPT_LENS]


def _assert_all_match(hf, path, requests: list[Request], outputs) -> None:
    for r in requests:
        out = outputs[r.request_id]
        assert out.finish_reason == "length"
        hf.assert_greedy(path, r.prompt_token_ids, out.token_ids, NEW_TOKENS)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batch_of_prompts(arch, model_dir, make_engine, hf):
    path = model_dir(arch)
    engine = make_engine(path, block_size=16)
    plans = record_plans(engine)
    requests = _requests()
    outputs = run_to_completion(engine, requests)
    assert {rid for rid, _, _ in plans[0].scheduled} == {r.request_id for r in requests}
    _assert_all_match(hf, path, requests, outputs)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_chunked_prefill(arch, model_dir, make_engine, hf):
    path = model_dir(arch)
    engine = make_engine(path, block_size=4, max_num_batched_tokens=8)
    plans = record_plans(engine)
    requests = _requests()
    outputs = run_to_completion(engine, requests)
    _assert_all_match(hf, path, requests, outputs)
    assert max(p.num_tokens for p in plans) <= 8
    chunks = [(rid, s, n) for p in plans for rid, s, n in p.scheduled if s < int(rid[1:])]
    assert len([c for c in chunks if c[0] == "r40"]) >= 5  # the 40-token prompt in >= 5 chunks
    assert any(s % 4 for _, s, _ in chunks), "no chunk started inside a block"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_sequences_join_running_batch(arch, model_dir, make_engine, hf):
    path = model_dir(arch)
    engine = make_engine(path, block_size=4, max_num_batched_tokens=16)
    plans = record_plans(engine)
    third, first, second = _requests()
    results: dict = {}
    engine.add_request(first)
    for _ in range(4):
        step_into(engine, results)
    engine.add_request(second)  # its prompt is chunked while `first` decodes
    for _ in range(2):
        step_into(engine, results)
    engine.add_request(third)
    drive(engine, results)
    _assert_all_match(hf, path, [first, second, third], results)
    # `second`'s prompt chunks shared steps with `first`'s decodes.
    mixed = [p for p in plans if {"r17", "r40"} <= {rid for rid, _, _ in p.scheduled}]
    assert any(s < 40 for p in mixed for rid, s, _ in p.scheduled if rid == "r40")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_preemption_and_recompute(arch, model_dir, make_engine, hf):
    path = model_dir(arch)
    # 16 blocks of 4 slots: each sequence fits alone (the longest needs all 16), all three
    # together do not, so decoding must preempt and recompute. Without prefix caching, so the
    # recompute starts from scratch (tests/cluster/engine/test_prefix_cache.py covers it with).
    engine = make_engine(path, block_size=4, num_blocks=16, enable_prefix_caching=False)
    plans = record_plans(engine)
    seqs = []
    schedule = engine.scheduler.schedule

    def keep_preempted():
        out = schedule()
        seqs.extend(out.preempted)
        return out

    engine.scheduler.schedule = keep_preempted
    requests = _requests()
    outputs = run_to_completion(engine, requests)
    assert any(p.preempted for p in plans), "nothing was preempted"
    assert seqs and all(s.num_preemptions >= 1 for s in seqs)
    # A preempted sequence is recomputed: a later plan prefills it again from position 0.
    victim = plans[next(i for i, p in enumerate(plans) if p.preempted)].preempted[0]
    recomputed = [s for p in plans for rid, s, n in p.scheduled if rid == victim and n > 1]
    assert len(recomputed) >= 2 and recomputed[-1] == 0
    _assert_all_match(hf, path, requests, outputs)


def _edit_config(src, out, **changes):
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _hf_greedy_with(model, prompt_ids) -> list[int]:
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
    )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("arch", ["llama3-rope", "mistral"])
def test_variant_config_matters(arch, model_dir, hf, tmp_path):
    """Guards the premise of the variant cases: without its rope scaling / sliding window,
    the same weights give other greedy tokens for the 40-token prompt."""
    path = model_dir(arch)
    if arch == "mistral":
        assert json.loads((path / "config.json").read_text())["sliding_window"] == SLIDING_WINDOW
        plain = _edit_config(path, tmp_path / "plain", sliding_window=None)
    else:
        default_rope = {"rope_type": "default", "rope_theta": 10000.0}
        plain = _edit_config(path, tmp_path / "plain", rope_parameters=default_rope)
    long_prompt = prompt(40, seed=40)
    assert hf.greedy(path, long_prompt, NEW_TOKENS) != hf.greedy(plain, long_prompt, NEW_TOKENS)


@pytest.mark.parametrize(("arch", "suffix"), [("qwen2", ".bias"), ("qwen3", "_norm.weight")])
@torch.inference_mode()
def test_variant_weights_matter(arch, suffix, model_dir, hf):
    """Guards the premise: Qwen2's QKV biases and Qwen3's q/k norm weights are not the
    identity, so an engine that ignored them would fail the oracle cases."""
    path = model_dir(arch)
    plain = copy.deepcopy(hf.model(path))
    touched = 0
    for name, p in plain.named_parameters():
        if name.endswith(suffix) and "self_attn" in name:
            p.copy_(torch.zeros_like(p) if suffix == ".bias" else torch.ones_like(p))
            touched += 1
    assert touched
    long_prompt = prompt(40, seed=40)
    assert hf.greedy(path, long_prompt, NEW_TOKENS) != _hf_greedy_with(plain, long_prompt)


def test_engine_without_sliding_window_matches_oracle(model_dir, make_engine, hf, tmp_path):
    """The Mistral checkpoint with its window removed matches its own oracle too."""
    wide = _edit_config(model_dir("mistral"), tmp_path / "wide", sliding_window=None)
    engine = make_engine(wide, block_size=4, max_num_batched_tokens=8)
    requests = _requests()
    _assert_all_match(hf, wide, requests, run_to_completion(engine, requests))


def test_oracle_check_rejects_a_wrong_output(model_dir, hf):
    """The comparison itself is not vacuous: a changed token at a clear (not near-tie) step, or
    a short output, fails it."""
    path = model_dir("llama-gqa")
    ids = prompt(17, seed=17)
    run = hf.run(path, ids, NEW_TOKENS)
    margins = [float(t.values[0] - t.values[1]) for t in (lg.topk(2) for lg in run.logits)]
    step = max(range(NEW_TOKENS), key=margins.__getitem__)
    runner_up = int(run.logits[step].topk(2).indices[1])
    wrong = [*run.tokens[:step], runner_up, *run.tokens[step + 1 :]]
    with pytest.raises(AssertionError, match=f"step {step}"):
        hf.assert_greedy(path, ids, wrong, NEW_TOKENS)
    with pytest.raises(AssertionError):
        hf.assert_greedy(path, ids, run.tokens[:-1], NEW_TOKENS)
    hf.assert_greedy(path, ids, run.tokens, NEW_TOKENS)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_engine_matches_cpu_oracle(arch, model_dir, make_engine, hf):
    path = model_dir(arch)
    engine = make_engine(path, device="cuda", block_size=4, max_num_batched_tokens=8)
    requests = _requests()
    _assert_all_match(hf, path, requests, run_to_completion(engine, requests))
