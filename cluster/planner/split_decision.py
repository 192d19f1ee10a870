"""`decide_split`: the prefill:decode split of a fixed number of engine replicas that the
simulator predicts serves an observed workload best, for the run-time ratio policy
(`split_policy.SplitPolicy`).

The workload is what the pools saw over a recent window (`MixObservation`: requests, their
mean prompt and output lengths, the arrival rate), replayed as a synthetic mix of
`sim_requests` requests of those mean lengths at that rate, the same seed for every split,
so a decision is a function of its inputs. Each split P:(N-P) the pools' bounds allow is
simulated; the best has the highest goodput (requests/s meeting both SLOs). Splits within
`GOODPUT_TIE` of it tie (a light load meets the SLOs on most splits), and among them the one
whose worse p90 latency, as a share of its SLO (TTFT, or TPOT for ITL), is lowest wins: the
split with the most headroom in the pool that binds. Inputs are rounded to `BUCKET` steps
first (`MixObservation.bucketed`), so noise in the window does not flip the split and
repeated windows hit `SplitCache`.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from cluster.planner.profile import Profile
from cluster.planner.sim_result import Summary
from cluster.planner.sim_workload import RequestClass, mix_requests
from cluster.planner.simulator import ClusterShape, Simulator

GOODPUT_TIE = 0.02  # goodputs within 2 % of the best are equal
BUCKET = 1.15  # lengths and rate are rounded to powers of this before simulating
CACHE_SIZE = 256


@dataclass(frozen=True)
class MixObservation:
    """What the pools served over `span_s` seconds: `requests` prefilled, their prompt tokens
    and their output tokens (the first token included)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    span_s: float

    @property
    def mean_input(self) -> float:
        return self.prompt_tokens / max(1, self.requests)

    @property
    def mean_output(self) -> float:
        return self.output_tokens / max(1, self.requests)

    @property
    def rate_rps(self) -> float:
        return self.requests / self.span_s if self.span_s > 0 else 0.0

    def bucketed(self) -> tuple[int, int, float]:
        """(prompt length, output length, rate) rounded to powers of `BUCKET`."""

        def snap(x: float) -> float:
            return BUCKET ** round(math.log(max(x, 1e-3), BUCKET))

        return (
            max(1, round(snap(self.mean_input))),
            max(1, round(snap(self.mean_output))),
            (round(snap(self.rate_rps), 4)),
        )


@dataclass(frozen=True)
class SplitSearch:
    """The search's fixed inputs: `total_replicas` engine replicas to split, each pool's
    (min, max) replicas, the SLOs, the synthetic mix's size and seed."""

    total_replicas: int
    prefill_bounds: tuple[int, int]
    decode_bounds: tuple[int, int]
    slo_ttft_s: float
    slo_itl_s: float
    sim_requests: int = 48
    seed: int = 0

    def splits(self) -> list[int]:
        """The prefill sizes P such that P and total - P are within both pools' bounds."""
        lo = max(self.prefill_bounds[0], self.total_replicas - self.decode_bounds[1], 1)
        hi = min(self.prefill_bounds[1], self.total_replicas - self.decode_bounds[0])
        return [p for p in range(lo, hi + 1) if self.total_replicas - p >= 1]


@dataclass(frozen=True)
class SplitDecision:
    """A chosen split and why: the (bucketed) mix it was simulated on and what the simulator
    predicts for it. `candidates`: (P, goodput req/s) of every split simulated."""

    prefill_replicas: int
    decode_replicas: int
    mean_input: int
    mean_output: int
    rate_rps: float
    goodput_rps: float
    attainment: float
    candidates: tuple[tuple[int, float], ...]
    sim_seconds: float = 0.0

    @property
    def split(self) -> str:
        return f"{self.prefill_replicas}P:{self.decode_replicas}D"

    def describe(self) -> str:
        """One log line."""
        others = ", ".join(f"{p}P {g:.2f}" for p, g in self.candidates)
        return (
            f"split {self.split} for prompts ~{self.mean_input} tokens, outputs "
            f"~{self.mean_output} tokens at {self.rate_rps:.2f} req/s: predicted goodput "
            f"{self.goodput_rps:.2f} req/s, attainment {self.attainment:.0%} "
            f"(goodput by prefill size: {others}; simulated in {self.sim_seconds * 1e3:.0f} ms)"
        )


def decide_split(profile: Profile, mix: MixObservation, search: SplitSearch) -> SplitDecision:
    """The best split of `search.total_replicas` for `mix` (see the module docstring). Raises
    ValueError when the bounds allow no split."""
    splits = search.splits()
    if not splits:
        raise ValueError(f"no split of {search.total_replicas} replicas fits the pools' bounds")
    began = time.perf_counter()
    n_in, n_out, rate = mix.bucketed()
    requests = mix_requests(
        [RequestClass(n_in, n_out)],
        search.sim_requests,
        rate,
        profile.limits.block_size,
        search.seed,
    )
    summaries: dict[int, Summary] = {}
    tp = profile.tensor_parallel_size  # replicas of the size the top-level models are for
    for p in splits:
        shape = ClusterShape(
            prefill_replicas=p, decode_replicas=search.total_replicas - p, prefill_tp=tp,
            decode_tp=tp,
        )  # fmt: skip
        result = Simulator(profile, shape, search.seed).run(requests)
        summaries[p] = result.summary(search.slo_ttft_s, search.slo_itl_s)
    best_goodput = max(s.goodput_rps for s in summaries.values())
    tied = [p for p, s in summaries.items() if s.goodput_rps >= best_goodput * (1 - GOODPUT_TIE)]
    best = min(tied, key=lambda p: (_latency_share(summaries[p], search), p))
    s = summaries[best]
    return SplitDecision(
        prefill_replicas=best,
        decode_replicas=search.total_replicas - best,
        mean_input=n_in,
        mean_output=n_out,
        rate_rps=rate,
        goodput_rps=s.goodput_rps,
        attainment=s.attainment,
        candidates=tuple((p, summaries[p].goodput_rps) for p in splits),
        sim_seconds=time.perf_counter() - began,
    )


def _latency_share(s: Summary, search: SplitSearch) -> float:
    """The worse of p90 TTFT / TTFT SLO and p90 TPOT / ITL SLO (NaN, no requests done: inf)."""
    shares = (s.ttft_s["p90"] / search.slo_ttft_s, s.tpot_s["p90"] / search.slo_itl_s)
    worst = max(x if x == x else 0.0 for x in shares)
    return worst if s.completed else math.inf


class SplitCache:
    """`decide_split` memoized on the bucketed mix (the search and profile fixed), least
    recently used entries dropped beyond `size`."""

    def __init__(self, profile: Profile, search: SplitSearch, size: int = CACHE_SIZE) -> None:
        self.profile, self.search, self.size = profile, search, size
        self._memo: OrderedDict[tuple[int, int, float], SplitDecision] = OrderedDict()

    def decide(self, mix: MixObservation) -> SplitDecision:
        key = mix.bucketed()
        if key in self._memo:
            self._memo.move_to_end(key)
            return replace(self._memo[key], sim_seconds=0.0)
        decision = decide_split(self.profile, mix, self.search)
        self._memo[key] = decision
        if len(self._memo) > self.size:
            self._memo.popitem(last=False)
        return decision
