"""`plan`: which shape of N engine replicas serves a workload best under SLOs. The candidates
are every prefill:decode split P:(N-P), P = 1..N-1, and N colocated replicas; each is
simulated on the same requests with the same seed, and the best has the highest goodput
(requests/s meeting both SLOs), then the highest attainment, then the lowest p90 TTFT.

With many replicas not every split is simulated: goodput rises with P while prefill is the
bottleneck and falls once decode is, so the search evaluates an even grid of splits, then
halves the step around the best until it is 1 (`MAX_EXHAUSTIVE` splits or fewer: all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from cluster.planner.profile import Profile
from cluster.planner.sim_result import Summary
from cluster.planner.sim_workload import SimRequest
from cluster.planner.simulator import ClusterShape, Simulator

MAX_EXHAUSTIVE = 16
GRID_POINTS = 8


@dataclass(frozen=True)
class Candidate:
    shape: ClusterShape
    summary: Summary

    def rank(self) -> tuple[float, float, float]:
        p90 = self.summary.ttft_s["p90"]
        return (self.summary.goodput_rps, self.summary.attainment, -p90 if p90 == p90 else -1e18)


@dataclass(frozen=True)
class Plan:
    candidates: list[Candidate]  # colocated first, then by P
    best: Candidate


def plan(
    profile: Profile,
    requests: list[SimRequest],
    replicas: int,
    slo_ttft_s: float,
    slo_itl_s: float,
    base: ClusterShape = ClusterShape(),
    seed: int = 0,
) -> Plan:
    """Simulate the candidate shapes of `replicas` replicas (`base` gives everything but the
    mode and sizes) and pick the best."""
    if replicas < 1:
        raise ValueError("plan needs at least one replica")

    def run(shape: ClusterShape) -> Candidate:
        result = Simulator(profile, shape, seed).run(requests)
        return Candidate(shape, result.summary(slo_ttft_s, slo_itl_s))

    colocated = run(replace(base, mode="colocated", prefill_replicas=0, decode_replicas=replicas))
    split: dict[int, Candidate] = {}

    def at(p: int) -> Candidate:
        if p not in split:
            split[p] = run(
                replace(
                    base, mode="disaggregated", prefill_replicas=p, decode_replicas=replicas - p
                )
            )
        return split[p]

    splits = replicas - 1
    if 0 < splits <= MAX_EXHAUSTIVE:
        for p in range(1, replicas):
            at(p)
    elif splits > MAX_EXHAUSTIVE:
        step = math.ceil(splits / GRID_POINTS)
        for p in range(1, replicas, step):
            at(p)
        at(replicas - 1)
        best = max(split.values(), key=Candidate.rank).shape.prefill_replicas
        while step > 1:
            step = math.ceil(step / 2)
            for p in (best - step, best + step):
                if 1 <= p < replicas:
                    at(p)
            best = max(split.values(), key=Candidate.rank).shape.prefill_replicas
    candidates = [colocated, *(split[p] for p in sorted(split))]
    return Plan(candidates, max(candidates, key=Candidate.rank))
