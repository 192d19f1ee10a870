"""The run-time ratio policy's decision (`decide_split`, `SplitRounds`) on synthetic
observation windows: a prompt-heavy window gets more prefill replicas than a decode-heavy
one, too few requests give no decision, the same inputs the same split, each round cheap."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cluster.planner.mix_window import MixWindow, ReplicaCounters
from cluster.planner.profile import Profile
from cluster.planner.split_decision import MixObservation, SplitCache, SplitSearch, decide_split
from cluster.planner.split_planner import PlannerSettings, SplitRounds

PROFILE = Path(__file__).parents[3] / "cluster/planner/profiles/cpu-small-v1.json"
PROMPT_HEAVY = MixObservation(requests=40, prompt_tokens=40 * 900, output_tokens=80, span_s=20)
DECODE_HEAVY = MixObservation(requests=20, prompt_tokens=20 * 8, output_tokens=4000, span_s=20)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return Profile.load(PROFILE)


def search(total: int = 4) -> SplitSearch:
    return SplitSearch(total, (1, total - 1), (1, total - 1), slo_ttft_s=3.0, slo_itl_s=0.2)


@pytest.mark.parametrize("total", [3, 4, 8])
def test_prompt_heavy_gets_more_prefill_than_decode_heavy(profile, total):
    prompt = decide_split(profile, PROMPT_HEAVY, search(total))
    decode = decide_split(profile, DECODE_HEAVY, search(total))
    assert prompt.prefill_replicas > decode.prefill_replicas
    assert prompt.prefill_replicas + prompt.decode_replicas == total
    assert decode.decode_replicas > decode.prefill_replicas
    assert "predicted goodput" in prompt.describe()


def test_same_window_same_split_and_each_decision_is_cheap(profile):
    began = time.perf_counter()
    first = decide_split(profile, DECODE_HEAVY, search(4))
    assert time.perf_counter() - began < 0.5
    again = decide_split(profile, DECODE_HEAVY, search(4))
    assert (again.split, again.candidates, again.goodput_rps) == (
        first.split,
        first.candidates,
        first.goodput_rps,
    )


def test_bounds_limit_the_splits(profile):
    bounded = SplitSearch(4, (1, 2), (2, 3), 3.0, 0.2)
    assert bounded.splits() == [1, 2]
    assert decide_split(profile, PROMPT_HEAVY, bounded).prefill_replicas == 2
    with pytest.raises(ValueError, match="no split"):
        decide_split(profile, PROMPT_HEAVY, SplitSearch(4, (1, 1), (1, 2), 3.0, 0.2))


def test_cache_answers_a_nearby_window_without_simulating(profile):
    cache = SplitCache(profile, search(4))
    first = cache.decide(PROMPT_HEAVY)
    nearby = MixObservation(40, 40 * 905, 80, 20.1)  # the same buckets
    began = time.perf_counter()
    second = cache.decide(nearby)
    assert time.perf_counter() - began < 0.01
    assert (second.split, second.sim_seconds) == (first.split, 0.0)


def settings(**kw) -> PlannerSettings:
    base = dict(
        app_name="a",
        registry_name="r",
        registry_namespace="n",
        profile=str(PROFILE),
        total_replicas=3,
        prefill_bounds=(1, 2),
        decode_bounds=(1, 2),
        slo_ttft_s=3.0,
        slo_itl_s=0.2,
        interval_s=1.0,
        window_s=10.0,
        min_requests=8,
        sim_requests=48,
    )
    return PlannerSettings(**{**base, **kw})


def served(prefilled: int, prompt_len: int, output_len: int) -> list[ReplicaCounters]:
    """Counters after `prefilled` requests of these lengths on one replica a pool."""
    return [
        ReplicaCounters("prefill", "p0", prefilled, prefilled * prompt_len),
        ReplicaCounters("decode", "d0", prefilled * (output_len - 1), 0),
        ReplicaCounters("router", "r0", 0, 0),
    ]


def test_rounds_follow_the_mix_and_defer_with_too_few_requests():
    rounds = SplitRounds(settings())
    assert rounds.round(0.0, served(0, 1, 1)).decision is None  # the baseline
    state = rounds.round(1.0, served(4, 900, 2))
    assert state.decision is None and "fewer than 8" in state.reason
    prompt = rounds.round(2.0, served(20, 900, 2)).decision
    assert prompt is not None and prompt.split == "2P:1D"
    # decode-heavy requests from now on; the window (10 s) forgets the prompt-heavy ones
    n = 20
    for t in range(3, 16):
        n += 3
        state = rounds.round(float(t), _shifted(n))
    assert state.decision is not None and state.decision.split == "1P:2D"
    assert [d.split for _, d in state.history] == ["2P:1D", "1P:2D"]


def _shifted(n: int) -> list[ReplicaCounters]:
    """20 prompt-heavy requests (900 in, 2 out), then n - 20 decode-heavy ones (8 in, 200 out)."""
    later = n - 20
    return [
        ReplicaCounters("prefill", "p0", n, 20 * 900 + later * 8),
        ReplicaCounters("decode", "d0", 20 * 1 + later * 199, 0),
    ]


def test_no_profile_means_no_decision(tmp_path):
    missing = SplitRounds(settings(profile=str(tmp_path / "none.json")))
    missing.round(0.0, served(0, 1, 1))
    state = missing.round(1.0, served(50, 900, 2))
    assert state.decision is None and state.reason.startswith("no profile")


def test_window_counts_growth_per_replica_not_membership():
    w = MixWindow(window_s=10.0)
    w.add(0.0, [ReplicaCounters("prefill", "p0", 100, 1000)])  # baseline: history unknown
    assert w.observation(0.0).requests == 0
    p0, p1 = ReplicaCounters("prefill", "p0", 104, 1040), ReplicaCounters("prefill", "p1", 2, 20)
    w.add(1.0, [p0, p1])  # p1 is new: all it has counts
    w.add(2.0, [ReplicaCounters("prefill", "p1", 3, 30)])  # p0 gone: adds nothing, no negative
    obs = w.observation(2.0)
    assert (obs.requests, obs.prompt_tokens, obs.span_s) == (7, 70, 2.0)
    assert w.observation(12.5).requests == 0  # aged out
