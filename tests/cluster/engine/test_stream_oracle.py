"""soak_bench's oracle (benchmarks/stream_oracle.py) on the engine's own streams: greedy and
seeded sampled tokens pass, a token changed anywhere fails."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.engine.engine import Engine
from cluster.engine.stream_oracle import StreamOracle
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.conftest import engine_config, greedy, prompt, run_to_completion

SAMPLED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, ignore_eos=True)


@pytest.fixture(scope="module")
def served(model_dir):
    """(oracle, [(prompt, tokens, params)]): 3 greedy and 3 seeded sampled streams made by the
    engine in one batch."""
    path = model_dir("llama-gqa")
    engine = Engine(engine_config(path))
    cases = [(prompt(20 + i, i), greedy(24) if i < 3 else replace(SAMPLED, seed=i))
             for i in range(6)]  # fmt: skip
    out = run_to_completion(engine, [Request(f"r{i}", p, q) for i, (p, q) in enumerate(cases)])
    streams = [(p, list(out[f"r{i}"].token_ids), q) for i, (p, q) in enumerate(cases)]
    return StreamOracle(str(path)), streams


def test_the_engines_greedy_and_seeded_streams_pass(served) -> None:
    oracle, streams = served
    verdicts = [oracle.check(p, tokens, q) for p, tokens, q in streams]
    assert all(len(tokens) == 24 for _, tokens, _ in streams)
    assert set(verdicts) <= {"exact", "boundary"} and verdicts.count("exact") >= 5, verdicts


@pytest.mark.parametrize("at", [0, 11, 23])
def test_a_token_changed_anywhere_is_wrong(served, at) -> None:
    oracle, streams = served
    for p, tokens, q in streams:
        bad = list(tokens)
        bad[at] = (bad[at] + 256) % 512  # far from it in the running sum
        assert oracle.check(p, bad, q) == "wrong", (q, at)


def test_a_sampled_stream_checked_under_another_seed_is_wrong(served) -> None:
    oracle, streams = served
    p, tokens, q = streams[3]
    assert oracle.check(p, tokens, replace(q, seed=999)) == "wrong"
