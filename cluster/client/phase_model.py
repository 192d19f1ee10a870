"""A model of where one request's time goes, fitted to a running cluster: prefill time
quadratic in the prompt length (attention reads all the prompt before each token), KV
transfer time linear in it, decode time linear in the output length, fixed
costs for the proxy and the router's hops. `pdserve phases` fits it with a few probe
requests sent one at a time, predicts each phase for a workload's requests, then measures
the same workload and shows both.

The prediction is for an idle cluster and an uncached prompt: where the measured phases run
longer (queueing, batching with other requests) or shorter (prefix-cache hits), the difference
between the two columns is that effect.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass

import numpy as np

from cluster.client.bench_summary import PHASES, phase_seconds
from cluster.client.load_generator import RequestRecord
from cluster.client.workload import Workload, WorkloadRequest, synthetic_workload

PROBE_OUTPUT_TOKENS = 2  # the prefill's token and one decode step: KV moves, decode barely runs
DECODE_PROBE_TOKENS = 32


@dataclass(frozen=True)
class Curve:
    """seconds = c0 + c1 * n + c2 * n^2 ..., each coefficient >= 0."""

    coeffs: tuple[float, ...]  # lowest power first

    def at(self, n: float) -> float:
        return max(0.0, sum(c * n**i for i, c in enumerate(self.coeffs)))

    @staticmethod
    def fit(points: list[tuple[float, float]], degree: int) -> Curve:
        """Least squares with every coefficient >= 0 (a cost has no negative part): the best
        fit over the subsets of powers 0..degree whose own fit is non-negative."""
        xs = np.array([x for x, _ in points], dtype=float)
        ys = np.array([y for _, y in points], dtype=float)
        if len(set(xs.tolist())) <= degree:
            raise ValueError(f"a degree-{degree} fit needs points at {degree + 1} or more lengths")
        best, best_err = (0.0,) * (degree + 1), float(np.sum(ys**2))
        for powers in itertools.chain.from_iterable(
            itertools.combinations(range(degree + 1), k) for k in range(1, degree + 2)
        ):
            basis = np.stack([xs**p for p in powers], axis=1)
            c, *_ = np.linalg.lstsq(basis, ys, rcond=None)
            err = float(np.sum((basis @ c - ys) ** 2))
            if (c >= 0).all() and err < best_err:
                full = [0.0] * (degree + 1)
                for p, v in zip(powers, c, strict=True):
                    full[p] = float(v)
                best, best_err = tuple(full), err
        return Curve(best)

    def describe(self, unit: str) -> str:
        """E.g. "12.0 ms + 2.41 us x n + 0.0010 us x n^2", n in `unit`s."""
        parts = [f"{self.coeffs[0] * 1e3:.1f} ms"]
        for i, c in enumerate(self.coeffs[1:], 1):
            parts.append(f"{c * 1e6:.4g} us x {unit}" + (f"^{i}" if i > 1 else ""))
        return " + ".join(parts)


@dataclass(frozen=True)
class PhaseModel:
    prefill: Curve  # seconds for a prompt of n tokens: quadratic (attention over the prompt)
    kv_transfer: Curve  # seconds to move a prompt of n tokens' KV (zero when colocated): linear
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
            prefill=Curve.fit([(r.prompt_tokens, p["prefill"]) for r, p in split], 2),
            kv_transfer=Curve.fit([(r.prompt_tokens, p["kv_transfer"]) for r, p in split], 1),
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
