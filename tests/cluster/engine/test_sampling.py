"""Seeded sampling is reproducible whatever shares the batch and whichever engine runs the step;
the sampler's filters and draws behave as documented."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.launch_count import HOST_SYNCS, dispatched
from cluster.engine.sampler import Sampler, draw, filtered_probs, mix_seed, uniform
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import disaggregated, drive, greedy, prompt, run_to_completion, step_into

SEEDED = SamplingParams(
    temperature=0.8, top_k=50, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True
)
OTHERS = [
    greedy(10),
    SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=4321, max_tokens=16),
    SamplingParams(temperature=1.5, top_k=5, max_tokens=7, ignore_eos=True),  # unseeded
    greedy(20),
    SamplingParams(temperature=0.5, top_p=0.5, seed=7, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=2.0, seed=1234, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=5, ignore_eos=True),
]
PROMPT = prompt(13, seed=5)


@pytest.fixture
def path(model_dir):
    return model_dir("llama-gqa")


def _alone(make_engine, path, params=SEEDED, ids=PROMPT) -> list[int]:
    engine = make_engine(path, block_size=16)
    out = run_to_completion(engine, [Request("s", ids, params)])["s"]
    assert len(out.token_ids) == params.max_tokens
    return out.token_ids


def test_seeded_request_same_alone_and_in_a_batch(make_engine, path):
    alone = _alone(make_engine, path)
    engine = make_engine(path, block_size=4, max_num_batched_tokens=16)
    others = [Request(f"o{i}", prompt(5 + 4 * i, seed=i), p) for i, p in enumerate(OTHERS)]
    for r in others[:4]:
        engine.add_request(r)
    results: dict = {}
    for _ in range(3):
        step_into(engine, results)
    engine.add_request(Request("s", PROMPT, SEEDED))  # joins mid-way, prefill chunked
    for r in others[4:]:
        engine.add_request(r)
    drive(engine, results)
    assert results["s"].token_ids == alone
    assert all(results[r.request_id].finish_reason is not None for r in others)


def test_seeded_sampling_is_not_greedy(make_engine, path):
    assert _alone(make_engine, path) != _alone(make_engine, path, greedy(SEEDED.max_tokens))


def test_different_seeds_give_different_outputs(make_engine, path):
    other = dataclasses.replace(SEEDED, seed=SEEDED.seed + 1)
    assert _alone(make_engine, path) != _alone(make_engine, path, other)


def test_same_seed_same_output_across_engines_and_chunking(make_engine, path):
    engine = make_engine(path, block_size=4, max_num_batched_tokens=5)
    out = run_to_completion(engine, [Request("s", PROMPT, SEEDED)])["s"]
    assert out.token_ids == _alone(make_engine, path)


def test_unseeded_requests_draw_independently(make_engine, path):
    params = dataclasses.replace(SEEDED, seed=None)
    engine = make_engine(path)
    outs = run_to_completion(engine, [Request(f"u{i}", PROMPT, params) for i in range(2)])
    assert outs["u0"].token_ids != outs["u1"].token_ids


def test_seeded_sampling_through_export_import_equals_colocated(make_engine, path):
    a = make_engine(path, block_size=4)
    b = make_engine(path, block_size=4)
    b.add_request(Request("other", prompt(7, seed=8), OTHERS[1]))  # B is busy already
    b.step()
    assert disaggregated(a, b, "s", PROMPT, SEEDED) == _alone(make_engine, path)


# -- the sampler alone ------------------------------------------------------------------------


def _logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(logits: torch.Tensor, p: SamplingParams, seeds, positions=None) -> list[int]:
    positions = positions if positions is not None else [0] * len(seeds)
    return Sampler()(logits, [p] * len(seeds), list(seeds), positions)


def test_greedy_is_argmax():
    logits = _logits(20)
    assert _sample(logits, greedy(1), range(20)) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=5.0, top_k=1, top_p=0.5),
    ],
    ids=["top_k=1", "top_p tiny", "both"],
)
def test_narrow_filters_equal_greedy(params):
    logits = _logits(50, seed=1)
    assert _sample(logits, params, range(50)) == logits.argmax(-1).tolist()


def test_mix_seed_is_deterministic_and_decorrelated():
    assert mix_seed(1234, 5) == mix_seed(1234, 5)
    values = {mix_seed(s, i) for s in (0, 1, 1234, 2**63 - 1) for i in range(100)}
    assert len(values) == 400
    assert all(0 <= v < 2**63 for v in values)


def test_sampler_row_independent_of_batch():
    logits = _logits(6, seed=2)
    p = SamplingParams(temperature=1.0, seed=1)
    seeds, positions = [11, 12, 13, 14, 15, 16], [0, 3, 1, 4, 1, 5]
    batch = Sampler()(logits, [p] * 6, seeds, positions)
    for row in range(6):
        alone = Sampler()(logits[row : row + 1], [p], [seeds[row]], [positions[row]])
        assert alone == [batch[row]]
    mixed = Sampler()(logits, [greedy(1), p, greedy(1), p, p, greedy(1)], seeds, positions)
    assert [mixed[i] for i in (1, 3, 4)] == [batch[i] for i in (1, 3, 4)]


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = SamplingParams(temperature=0.7)
    n = 4000
    draws = torch.tensor([_sample(logits, p, [s])[0] for s in range(n)])
    freq = torch.bincount(draws, minlength=5).float() / n
    want = torch.softmax(logits[0] / 0.7, -1)
    assert torch.allclose(freq, want, atol=0.025), (freq, want)


def test_top_k_and_top_p_restrict_the_support():
    # probabilities 0.5, 0.3, 0.15, 0.05
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    seeds = range(500)
    top_k = {_sample(logits, SamplingParams(top_k=2), [s])[0] for s in seeds}
    assert top_k == {0, 1}
    # top_p 0.7: 0.5 < 0.7 so token 1 is needed too; 0.8 >= 0.7 so token 2 is not.
    top_p = {_sample(logits, SamplingParams(top_p=0.7), [s])[0] for s in seeds}
    assert top_p == {0, 1}
    full = {_sample(logits, SamplingParams(), [s])[0] for s in seeds}
    assert full == {0, 1, 2, 3}


def test_position_changes_the_draw():
    logits = _logits(1, seed=3).expand(64, -1) / 3  # 64 draws: ~32 distinct tokens expected
    p = SamplingParams(temperature=1.0)
    draws = Sampler()(logits, [p] * 64, [99] * 64, list(range(64)))
    assert len(set(draws)) > 20  # one seed at every position would draw one token


# -- batched filters and draws ----------------------------------------------------------------

MIXED = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.1, top_k=40, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.5, top_k=64),  # k = vocab: no cut
]


def test_each_rows_filters_read_that_row_alone():
    """Rows with different settings filtered together equal each row filtered alone, exactly,
    and each keeps what its own settings allow."""
    logits = _logits(len(MIXED), seed=4)
    batch = filtered_probs(logits, MIXED)
    for r, p in enumerate(MIXED):
        assert torch.equal(batch[r : r + 1], filtered_probs(logits[r : r + 1], [p])), r
    kept = (batch > 0).sum(-1).tolist()
    assert kept[0] == kept[5] == 64 and kept[1] == 5 and min(kept[2:5]) < 64


def test_draw_is_the_inverse_cdf_and_never_picks_a_filtered_token():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.25, 0.5, 0.0]]).expand(7, -1)
    u = [0.0, 0.2499, 0.25, 0.4999, 0.5, 0.99, uniform(2**63 - 1)]
    assert draw(probs, torch.tensor(u, dtype=torch.float64)).tolist() == [1, 1, 3, 3, 4, 4, 4]
    # Unnormalised rows: the fraction is of the row's own total.
    assert draw(torch.tensor([[0.0, 2.0, 2.0]]), torch.tensor([0.5], dtype=torch.float64)) == 2


def test_uniform_spans_zero_to_one_and_stays_below_it():
    us = [uniform(mix_seed(7, i)) for i in range(4000)]
    assert 0.0 <= min(us) < 0.01 and 0.99 < max(us) < 1.0
    assert uniform(2**63 - 1) == 1 - 2.0**-40
    counts = torch.histc(torch.tensor(us), bins=10, min=0.0, max=1.0)
    assert counts.min() > 320 and counts.max() < 480  # 400 a bin expected


def test_a_step_of_sampled_rows_reads_nothing_back_but_its_tokens():
    """Greedy, sampled and adjusted rows together dispatch no op that would wait on a GPU: the
    tokens come back in one copy at the end (`tolist`, which dispatches nothing)."""
    logits = _logits(8, seed=6)
    params = [greedy(1), *MIXED, SamplingParams(temperature=1.0, repetition_penalty=1.5)]
    histories = [[1, 2, 3]] * 8
    ops = dispatched(lambda: Sampler()(logits, params, list(range(8)), [2] * 8, histories))
    assert {"aten.sort", "aten.searchsorted"} <= ops, ops
    assert not ops & HOST_SYNCS, ops & HOST_SYNCS
