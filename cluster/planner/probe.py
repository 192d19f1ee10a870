"""Probing a running deployment for a `Profile`, over the public gRPC API: a designed set of
requests, each with fresh random tokens (no prefix-cache hits), read through the per-request
`timing` the server returns.

- Prefill probes, one at a time, 2 output tokens: prompts of several lengths from 16 tokens to
  a few token budgets (so chunking shows), each `repeats` times. Their `prefill` timing gives
  the prefill step model, their `kv_transfer` the KV model, the router's share of the time to
  first token (`ttft - queue - prefill`) and the client's time outside the router the
  overheads (medians).
- Decode probes: B requests sent together, for each batch size B and prompt length, with
  `decode_output` tokens each. A request's steps after its second token (`(last - second) /
  (n - 2)`, client times: the KV hop and the batch's joining are before it), at the median
  over the group's requests on one decode replica (`timing.decode_replica`), give one decode
  sample at that replica's batch b and b x (prompt + 1 + n / 2) context tokens.

`fit_profile` is the pure half (records in, `Profile` out); `run_probes` sends them.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass

from cluster.client.load_generator import RequestRecord, run_workload
from cluster.client.workload import Workload, WorkloadRequest, synthetic_workload
from cluster.planner.profile import EngineLimits, Overheads, Profile
from cluster.planner.step_fit import (
    DecodeSample,
    PrefillSample,
    TransferSample,
    fit_decode,
    fit_prefill,
    fit_transfer,
)

PREFILL_OUTPUT = 2


@dataclass(frozen=True)
class ProbePlan:
    prefill_lengths: tuple[int, ...]
    repeats: int
    decode_batches: tuple[int, ...]
    decode_prompts: tuple[int, ...]
    decode_output: int

    @staticmethod
    def design(
        max_context: int, limits: EngineLimits, repeats: int = 2, decode_output: int = 32
    ) -> ProbePlan:
        longest = max(64, min(max_context - PREFILL_OUTPUT - 1, 3 * limits.max_num_batched_tokens))
        lengths = sorted({16, *(round(longest / 2**k) for k in range(5))})
        batches = tuple(b for b in (1, 2, 4, 8, 16) if b <= limits.max_num_seqs)
        # the largest batch's prompts and outputs fit one replica's KV pool: no preemption
        pool_tokens = limits.num_kv_blocks * limits.block_size // max(batches)
        room = max(1, min(max_context, pool_tokens) - decode_output - 1)
        prompts = tuple(sorted({min(16, room), min(longest // 2, room)}))
        return ProbePlan(tuple(lengths), repeats, batches, prompts, decode_output)

    @property
    def requests(self) -> int:
        decode = sum(self.decode_batches) * len(self.decode_prompts)
        return len(self.prefill_lengths) * self.repeats + decode


@dataclass(frozen=True)
class ProbeRecords:
    prefill: list[RequestRecord]
    decode: list[tuple[int, int, list[RequestRecord]]]  # (batch, prompt tokens, records)


def fit_profile(
    records: ProbeRecords,
    limits: EngineLimits,
    transport: str,
    kv_bytes_per_token: int,
    decode_output: int,
    source: dict,
) -> Profile:
    """The profile the probe records show. Raises ValueError when too few probes finished."""
    pre = [r for r in records.prefill if r.ok and r.timing is not None]
    if len(pre) < 3:
        raise ValueError(f"only {len(pre)} prefill probes finished")
    budget = limits.max_num_batched_tokens
    prefill = fit_prefill(
        [
            PrefillSample(r.prompt_tokens, r.cached_prompt_tokens, r.timing.prefill, budget)
            for r in pre
        ]
    )
    moved = [
        TransferSample(r.prompt_tokens, r.timing.kv_transfer)
        for r in pre
        if r.timing.kv_transfer > 0
    ]
    if len(moved) < 2:
        raise ValueError("no KV transfer timed: profile a disaggregated deployment")
    kv = fit_transfer(moved, transport, kv_bytes_per_token)
    samples = []
    for _, prompt, group in records.decode:
        by_replica: dict[str, list[RequestRecord]] = {}
        for r in group:
            if r.ok and r.timing is not None and len(r.token_times) > 2:
                by_replica.setdefault(r.timing.decode_replica, []).append(r)
        for batch in by_replica.values():  # Serve spreads a group over the decode replicas
            steps = [
                (r.token_times[-1] - r.token_times[1]) / (len(r.token_times) - 2) for r in batch
            ]
            context = len(batch) * (prompt + 1 + decode_output / 2)
            samples.append(DecodeSample(len(batch), context, statistics.median(steps)))
    overheads = Overheads(
        routing_s=statistics.median(
            max(0.0, r.timing.time_to_first_token - r.timing.queue - r.timing.prefill) for r in pre
        ),
        proxy_s=statistics.median(max(0.0, r.e2e_s - r.timing.total) for r in pre),
    )
    counts = {"prefill_probes": len(pre), "decode_samples": len(samples)}
    return Profile(prefill, fit_decode(samples), (kv,), overheads, limits, {**source, **counts})


def run_probes(
    target: str, plan: ProbePlan, vocab_size: int, application: str | None = None, seed: int = 0,
    timeout_s: float = 600.0,
) -> ProbeRecords:  # fmt: skip
    """Send the plan's probes (after one warm-up request) and return their records."""

    def send(workload: Workload, concurrency: int | None) -> list[RequestRecord]:
        return asyncio.run(
            run_workload(target, workload, application, concurrency, timeout_s=timeout_s)
        )

    send(synthetic_workload(1, 16, 4, vocab_size, seed=seed - 1), None)
    single: list[WorkloadRequest] = []
    for k in range(plan.repeats):
        for i, n in enumerate(plan.prefill_lengths):
            one = synthetic_workload(1, n, PREFILL_OUTPUT, vocab_size, seed=seed + 100 * k + i)
            single += one.requests
    prefill = send(Workload(tuple(single), "prefill probes"), 1)
    decode = []
    for j, (batch, prompt) in enumerate(
        (b, p) for b in plan.decode_batches for p in plan.decode_prompts
    ):
        w = synthetic_workload(
            batch, prompt, plan.decode_output, vocab_size, seed=seed + 10_000 + j
        )
        decode.append((batch, prompt, send(w, None)))
    return ProbeRecords(prefill, decode)
