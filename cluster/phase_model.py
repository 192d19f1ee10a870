"""A model of where one request's time goes, fitted to a running cluster: prefill and KV
transfer time linear in the prompt length, decode time linear in the output length, fixed
costs for the proxy and the router's hops. `pdserve phases` fits it with a few probe
requests sent one at a time, predicts each phase for a workload's requests, then measures
the same workload and shows both.

The prediction is for an idle cluster and an uncached prompt: where the measured phases run
longer (queueing, batching with other requests) or shorter (prefix-cache hits), the difference
between the two columns is that effect.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from cluster.bench_summary import PHASES, phase_seconds
from cluster.load_generator import RequestRecord
from cluster.workload import Workload, WorkloadRequest, synthetic_workload

PROBE_OUTPUT_TOKENS = 2  # the prefill's token and one decode step: KV moves, decode barely runs
DECODE_PROBE_TOKENS = 32


@dataclass(frozen=True)
class Line:
    """seconds = intercept + slope * n, fitted by least squares."""

    intercept: float
    slope: float

    def at(self, n: float) -> float:
        return max(0.0, self.intercept + self.slope * n)

    @staticmethod
    def fit(points: list[tuple[float, float]]) -> Line:
        xs = [x for x, _ in points]
        if len(set(xs)) < 2:
            raise ValueError("a line needs points at two or more lengths")
        mx, my = statistics.fmean(xs), statistics.fmean(y for _, y in points)
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in points) / sxx
        return Line(my - slope * mx, slope)


@dataclass(frozen=True)
class PhaseModel:
    prefill: Line  # seconds for a prompt of n tokens
    kv_transfer: Line  # seconds to move a prompt of n tokens' KV (zero when colocated)
    proxy_s: float  # the client's time outside the router (Serve's gRPC proxy, the network)
    routing_s: float  # the rest of the time to first token: the router's hops
    decode_per_token_s: float  # per output token after the first, one request alone

    def predict(self, prompt_tokens: int, output_tokens: int) -> dict[str, float]:
        """Seconds per phase (`PHASES`) for one request alone on an idle cluster."""
        return {
            "proxy": self.proxy_s,
            "queue": 0.0,
            "prefill": self.prefill.at(prompt_tokens),
            "routing": self.routing_s,
            "kv_transfer": self.kv_transfer.at(prompt_tokens) if output_tokens > 1 else 0.0,
            "decode": max(0, output_tokens - 1) * self.decode_per_token_s,
        }

    def predict_mean(self, workload: Workload) -> dict[str, float]:
        each = [self.predict(len(r.prompt_token_ids), r.max_tokens) for r in workload.requests]
        return {k: statistics.fmean(p[k] for p in each) for k in PHASES}

    def decode_overtakes_at(self, prompt_tokens: int) -> float:
        """The output length from which decoding takes longer than prefill + KV transfer, for
        prompts of `prompt_tokens`."""
        before = self.prefill.at(prompt_tokens) + self.kv_transfer.at(prompt_tokens)
        if self.decode_per_token_s <= 0:
            return math.inf
        return 1 + math.floor(before / self.decode_per_token_s) + 1

    @staticmethod
    def fit(probes: list[RequestRecord]) -> PhaseModel:
        """From finished probe records: the prefill and KV points are the probes with
        `PROBE_OUTPUT_TOKENS` outputs, the decode rate from the longer ones."""
        done = [r for r in probes if r.ok]
        short = [r for r in done if r.output_tokens == PROBE_OUTPUT_TOKENS]
        long = [r for r in done if r.output_tokens > PROBE_OUTPUT_TOKENS]
        if not short or not long:
            failed = {r.status for r in probes if not r.ok}
            raise ValueError(f"the probe requests did not finish (status: {sorted(failed)})")
        split = [(r, phase_seconds(r)) for r in short]
        return PhaseModel(
            prefill=Line.fit([(r.prompt_tokens, p["prefill"]) for r, p in split]),
            kv_transfer=Line.fit([(r.prompt_tokens, p["kv_transfer"]) for r, p in split]),
            proxy_s=statistics.median(p["proxy"] for _, p in split),
            routing_s=statistics.median(p["routing"] for _, p in split),
            decode_per_token_s=statistics.median(
                phase_seconds(r)["decode"] / (r.output_tokens - 1) for r in long
            ),
        )


def probe_workload(max_context: int, vocab_size: int, longest: int, seed: int = 0) -> Workload:
    """Probes, sent one after another: prompts of a few lengths up to `longest` (2 outputs
    each, twice) and short prompts with `DECODE_PROBE_TOKENS` outputs. Every prompt is new, so
    none is served from the prefix cache."""
    longest = max(64, min(longest, max_context - DECODE_PROBE_TOKENS))
    lengths = sorted({16, longest // 4, longest // 2, longest})
    reqs: list[WorkloadRequest] = []
    for i, n in enumerate([*lengths, *lengths]):
        reqs += synthetic_workload(1, n, PROBE_OUTPUT_TOKENS, vocab_size, seed=seed + i).requests
    for i in range(3):
        reqs += synthetic_workload(
            1, 16, DECODE_PROBE_TOKENS, vocab_size, seed=seed + 1000 + i
        ).requests
    return Workload(tuple(reqs), f"{len(reqs)} probes, prompt lengths {lengths}")
