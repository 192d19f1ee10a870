"""`plan`: which shape of N engine replicas serves a workload best under SLOs. The candidates
are every prefill:decode split P:(N-P), P = 1..N-1, and N colocated replicas; each is
simulated on the same requests with the same seed, and the best has the highest goodput
(requests/s meeting both SLOs), then the highest attainment, then the lowest p90 TTFT.

`plan_gpus`: the same over N GPUs with tensor parallelism. The candidates are N/t colocated
replicas at TP t for each size t, and for each pair of sizes (tp, td) the splits P prefill
replicas at TP tp + D decode replicas at TP td that use all N GPUs (P tp + D td = N); a pair
with no such split (N not a multiple of td) takes D = (N - P tp) // td and leaves the rest
idle. Sizes are those the profile has and the app accepts (`COLOCATED_TP_SIZES`,
`DISAGGREGATED_TP_SIZES`, mirrored from `cluster.serving.pool_config`).

With many splits not every one is simulated: goodput rises with P while prefill is the
bottleneck and falls once decode is, so the search (`search_splits`, for each pair of sizes)
evaluates an even grid of splits, then halves the step around the best until it is 1
(`MAX_EXHAUSTIVE` splits or fewer: all).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from cluster.planner.profile import Profile
from cluster.planner.sim_result import Summary
from cluster.planner.sim_workload import SimRequest
from cluster.planner.simulator import ClusterShape, Simulator

MAX_EXHAUSTIVE = 16
GRID_POINTS = 8
# The tensor-parallel sizes a pool of each mode's app takes (cluster.serving.pool_config's
# TENSOR_PARALLEL_SIZES and DISAGGREGATED_TP_SIZES; a test keeps them equal).
COLOCATED_TP_SIZES = (1, 2, 4, 8)
DISAGGREGATED_TP_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class Candidate:
    shape: ClusterShape
    summary: Summary

    def rank(self) -> tuple[float, float, float]:
        p90 = self.summary.ttft_s["p90"]
        return (self.summary.goodput_rps, self.summary.attainment, -p90 if p90 == p90 else -1e18)


@dataclass(frozen=True)
class Plan:
    candidates: list[Candidate]  # colocated first, then by sizes and P
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
    run = _runner(profile, requests, slo_ttft_s, slo_itl_s, seed)
    colocated = run(replace(base, mode="colocated", prefill_replicas=0, decode_replicas=replicas))
    splits = [
        replace(base, mode="disaggregated", prefill_replicas=p, decode_replicas=replicas - p)
        for p in range(1, replicas)
    ]
    candidates = [colocated, *search_splits(splits, run)]
    return Plan(candidates, max(candidates, key=Candidate.rank))


def plan_gpus(
    profile: Profile,
    requests: list[SimRequest],
    gpus: int,
    slo_ttft_s: float,
    slo_itl_s: float,
    tp_choices: tuple[int, ...] | None = None,
    base: ClusterShape = ClusterShape(),
    seed: int = 0,
) -> Plan:
    """Simulate the shapes of `gpus` GPUs at the TP sizes `tp_choices` (default: the
    profile's) and pick the best. ValueError for a size the profile lacks or no app takes."""
    run = _runner(profile, requests, slo_ttft_s, slo_itl_s, seed)
    colocated, pairs = gpu_shapes(profile, gpus, tp_choices, base)
    candidates = [run(s) for s in colocated]
    for splits in pairs:
        candidates += search_splits(splits, run)
    if not candidates:
        raise ValueError(f"no shape of the TP sizes {tp_choices} fits {gpus} GPUs")
    return Plan(candidates, max(candidates, key=Candidate.rank))


def gpu_shapes(
    profile: Profile,
    gpus: int,
    tp_choices: tuple[int, ...] | None = None,
    base: ClusterShape = ClusterShape(),
) -> tuple[list[ClusterShape], list[list[ClusterShape]]]:
    """The colocated shapes, and per pair of sizes (tp, td) its splits ordered by P."""
    if gpus < 1:
        raise ValueError("plan needs at least one GPU")
    sizes = tuple(sorted(set(tp_choices or profile.tp_sizes())))
    missing = [t for t in sizes if t not in profile.tp_sizes()]
    if missing:
        raise ValueError(
            f"the profile has no models for TP {missing} (it has {profile.tp_sizes()})"
        )
    refused = [t for t in sizes if t not in COLOCATED_TP_SIZES]
    if refused:
        raise ValueError(f"no app takes TP {refused} (colocated: {COLOCATED_TP_SIZES})")
    colocated = [
        replace(base, mode="colocated", prefill_replicas=0, decode_replicas=gpus // t, decode_tp=t)
        for t in sizes
        if t <= gpus
    ]
    disagg = [t for t in sizes if t in DISAGGREGATED_TP_SIZES]
    pairs = []
    for tp in disagg:
        for td in disagg:
            fits = [(p, (gpus - p * tp) // td) for p in range(1, (gpus - td) // tp + 1)]
            exact = [(p, d) for p, d in fits if p * tp + d * td == gpus]
            splits = [
                replace(
                    base,
                    mode="disaggregated",
                    prefill_replicas=p,
                    decode_replicas=d,
                    prefill_tp=tp,
                    decode_tp=td,
                )  # fmt: skip
                for p, d in exact or fits
            ]
            if splits:
                pairs.append(splits)
    return colocated, pairs


def search_splits(
    splits: list[ClusterShape], run: Callable[[ClusterShape], Candidate]
) -> list[Candidate]:
    """The evaluated candidates of `splits` (ordered by P), in that order: all of them when
    there are `MAX_EXHAUSTIVE` or fewer, else a grid of `GRID_POINTS` refined around the best
    by halving the step."""
    done: dict[int, Candidate] = {}

    def at(i: int) -> Candidate:
        if i not in done:
            done[i] = run(splits[i])
        return done[i]

    n = len(splits)
    if n <= MAX_EXHAUSTIVE:
        for i in range(n):
            at(i)
    else:
        step = math.ceil(n / GRID_POINTS)
        for i in range(0, n, step):
            at(i)
        at(n - 1)
        best = max(done, key=lambda i: done[i].rank())
        while step > 1:
            step = math.ceil(step / 2)
            for i in (best - step, best + step):
                if 0 <= i < n:
                    at(i)
            best = max(done, key=lambda i: done[i].rank())
    return [done[i] for i in sorted(done)]


def _runner(
    profile: Profile, requests: list[SimRequest], slo_ttft_s: float, slo_itl_s: float, seed: int
) -> Callable[[ClusterShape], Candidate]:
    def run(shape: ClusterShape) -> Candidate:
        result = Simulator(profile, shape, seed).run(requests)
        return Candidate(shape, result.summary(slo_ttft_s, slo_itl_s))

    return run
