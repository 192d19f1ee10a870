"""What a `pdserve bench` run measured: throughput, latency distributions as the client saw
them, goodput under SLOs, the server's phase account of where each request's time went (when
the server gave one), prefix-cache reuse and how the requests spread over the replicas. Built
from the load generator's records; renders as Markdown lines or, with `vllm bench serve`'s
names, as the metrics of `bench_result`'s JSON document.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass

from cluster.client.load_generator import RequestRecord

PERCENTILES: tuple[float, ...] = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")  # the latencies `vllm bench serve` can report
# Where a request's end-to-end time, as the client saw it, goes. "proxy": the client's time
# outside the router's account (Serve's gRPC proxy, both ways, and the network); then the
# server's `timing`: before the first token, queue + prefill + routing (the rest of the
# router's TTFT: its hops to the pools, retries); after it, the KV transfer (disaggregated
# only) + decoding.
PHASES = ("proxy", "queue", "prefill", "routing", "kv_transfer", "decode")
# What a dominant phase points at, for the report's last line.
PHASE_HINTS = {
    "proxy": "the time is outside pdserve's account (Serve's gRPC proxy, the network, the "
    "client); check the client machine and its link to the cluster.",
    "queue": "requests wait for a prefilling engine (the prefill pool, or the colocated one): "
    "that pool is saturated; add replicas to it (or raise its autoscaling max_replicas).",
    "prefill": "prompt computation dominates: more prefill replicas raise throughput, not a "
    "prompt's own time; shared prefixes cut it (see the prefix-cache line above).",
    "routing": "the router's own hops to the pools dominate, which happens only when the "
    "model's work is tiny: check the router replicas' CPU.",
    "kv_transfer": "moving the KV dominates: on GPUs use the nccl transport, otherwise a faster "
    "network; a decode engine busy with large batches also delays the import.",
    "decode": "token generation dominates: decode replicas and their batch size "
    "(scheduler.max_num_seqs) set the throughput, memory bandwidth the time per token.",
}


def percentile(xs: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class Distribution:
    """Mean, population standard deviation (numpy's and vLLM's) and percentiles of one
    latency, in seconds, over `n` samples; nan where there are none."""

    n: int
    mean: float
    pct: dict[int, float]
    std: float = math.nan

    @staticmethod
    def of(xs: list[float], percentiles: tuple[float, ...] = PERCENTILES) -> Distribution:
        return Distribution(
            len(xs),
            statistics.fmean(xs) if xs else math.nan,
            {p: percentile(xs, p) for p in (*percentiles, 50)},
            statistics.pstdev(xs) if xs else math.nan,
        )

    def vllm_ms(self, metric: str) -> dict[str, float]:
        """`vllm bench serve`'s keys for this metric: `mean_ttft_ms`, `median_ttft_ms`,
        `std_ttft_ms`, `p99_ttft_ms`, ..."""
        return {
            f"mean_{metric}_ms": self.mean * 1e3,
            f"median_{metric}_ms": self.pct[50] * 1e3,
            f"std_{metric}_ms": self.std * 1e3,
            **{f"p{_pname(p)}_{metric}_ms": v * 1e3 for p, v in self.pct.items()},
        }


@dataclass(frozen=True)
class Goodput:
    """SLOs a request must meet, all given ones at once, to count towards goodput (`vllm
    bench serve --goodput ttft:500 tpot:50 e2el:2000`, milliseconds); None: no bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @staticmethod
    def parse(specs: list[str]) -> Goodput:
        """From `KEY:MS` pairs; raises ValueError naming a bad one."""
        bounds: dict[str, float] = {}
        for spec in specs:
            key, _, value = spec.partition(":")
            if key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"goodput {spec!r}: the key must be ttft, tpot or e2el")
            try:
                bounds[f"{key}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"goodput {spec!r}: expected KEY:MILLISECONDS") from None
            if not (math.isfinite(bounds[f"{key}_ms"]) and bounds[f"{key}_ms"] > 0):
                raise ValueError(f"goodput {spec!r}: milliseconds must be > 0")
        return Goodput(**bounds)

    def meets(self, r: RequestRecord) -> bool:
        tpot = r.tpot_s
        return (
            (self.ttft_ms is None or r.ttft_s * 1e3 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms)
            and (self.e2el_ms is None or r.e2e_s * 1e3 <= self.e2el_ms)
        )

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}


def phase_seconds(r: RequestRecord) -> dict[str, float]:
    """One finished request's end-to-end time split into `PHASES` (seconds, summing to the
    client's end to end, or the server's `total_seconds` where that is longer)."""
    t = r.timing
    assert t is not None
    routing = max(0.0, t.time_to_first_token - t.queue - t.prefill)
    decode = max(0.0, t.total - t.time_to_first_token - t.kv_transfer)
    return {
        "proxy": max(0.0, r.e2e_s - t.total),
        "queue": t.queue,
        "prefill": t.prefill,
        "routing": routing,
        "kv_transfer": t.kv_transfer,
        "decode": decode,
    }


@dataclass(frozen=True)
class BenchSummary:
    requests: int
    completed: int
    failures: dict[str, int]
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int
    reusable_tokens: int
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    phase_mean_s: dict[str, float]  # nan where no request carried the server's timing
    prefill_replicas: dict[str, int]
    decode_replicas: dict[str, int]
    slo_met: int | None = None  # requests that met every SLO of `goodput`
    max_concurrent: int = 0  # requests in flight at once, at most

    percentiles: tuple[float, ...] = PERCENTILES  # reported (`--metric-percentiles`)
    metrics_shown: tuple[str, ...] = METRICS  # latencies in the JSON (`--percentile-metrics`)

    @staticmethod
    def of(
        records: list[RequestRecord],
        goodput: Goodput | None = None,
        percentiles: tuple[float, ...] = PERCENTILES,
        metrics_shown: tuple[str, ...] = METRICS,
    ) -> BenchSummary:
        done = [r for r in records if r.ok]
        if done:
            began = min(r.sent_s for r in records)
            duration = max(r.token_times[-1] for r in done) - began
        else:
            duration = math.nan
        phases = [phase_seconds(r) for r in done if r.timing is not None]
        slo_met = None if goodput is None else sum(goodput.meets(r) for r in done)
        return BenchSummary(
            requests=len(records),
            completed=len(done),
            failures=dict(Counter(r.status for r in records if not r.ok)),
            duration_s=duration,
            prompt_tokens=sum(r.prompt_tokens for r in done),
            output_tokens=sum(r.output_tokens for r in done),
            cached_prompt_tokens=sum(r.cached_prompt_tokens for r in done),
            reusable_tokens=sum(r.reusable_tokens for r in done),
            ttft=Distribution.of([r.ttft_s for r in done], percentiles),
            tpot=Distribution.of([r.tpot_s for r in done if r.tpot_s is not None], percentiles),
            itl=Distribution.of([g for r in done for g in r.itl_s], percentiles),
            e2e=Distribution.of([r.e2e_s for r in done], percentiles),
            phase_mean_s={
                k: statistics.fmean(p[k] for p in phases) if phases else math.nan for k in PHASES
            },
            prefill_replicas=dict(Counter(r.timing.prefill_replica for r in done if r.timing)),
            decode_replicas=dict(Counter(r.timing.decode_replica for r in done if r.timing)),
            slo_met=slo_met,
            max_concurrent=_max_concurrent(done),
            percentiles=percentiles,
            metrics_shown=metrics_shown,
        )

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def dominant_phase(self) -> str:
        return max(self.phase_mean_s, key=lambda k: self.phase_mean_s[k])

    def phase_share(self, phase: str) -> float:
        total = sum(self.phase_mean_s.values())
        return self.phase_mean_s[phase] / total if total else math.nan

    @property
    def has_phases(self) -> bool:
        return not math.isnan(sum(self.phase_mean_s.values()))

    def metrics(self) -> dict:
        """The run's figures: `vllm bench serve`'s keys (`completed`, `request_throughput`,
        `mean_ttft_ms`, `p99_itl_ms`, `request_goodput`, ...), then pdserve's own. Floats may
        be nan; `bench_result.strict_json` writes those as null."""
        goodput = None if self.slo_met is None else self.slo_met / self.duration_s
        return {
            "duration": self.duration_s,
            "completed": self.completed,
            "failed": self.requests - self.completed,
            "total_input_tokens": self.prompt_tokens,
            "total_output_tokens": self.output_tokens,
            "request_throughput": self.request_throughput,
            "request_goodput": goodput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": (self.prompt_tokens + self.output_tokens) / self.duration_s,
            "max_concurrent_requests": self.max_concurrent,
            **{
                k: v
                for metric, d in (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl))
                + (("e2el", self.e2e),)
                if metric in self.metrics_shown
                for k, v in d.vllm_ms(metric).items()
            },
            "num_prompts": self.requests,
            "failures": self.failures,
            "slo_met": self.slo_met,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "reusable_prompt_tokens": self.reusable_tokens,
            "phases_mean_s": self.phase_mean_s,
            "dominant_phase": self.dominant_phase if self.has_phases else None,
            "prefill_replicas": self.prefill_replicas,
            "decode_replicas": self.decode_replicas,
        }

    def render(self) -> list[str]:
        """Markdown lines: totals, the latency table, the phase table."""
        failed = ", ".join(f"{k} {v}" for k, v in sorted(self.failures.items())) or "none"
        if not self.completed:
            return [f"- requests: none of {self.requests} completed (failed: {failed})"]
        lines = [
            f"- requests: {self.completed} of {self.requests} completed (failed: {failed}) "
            f"in {self.duration_s:.2f} s: {self.request_throughput:.2f} requests/s, "
            f"{self.output_throughput:.1f} output tokens/s",
            f"- tokens: {self.prompt_tokens} prompt ({self.cached_prompt_tokens} from the "
            f"prefix cache, {_share(self.cached_prompt_tokens, self.prompt_tokens)}; an "
            f"unbounded cache could have served {self.reusable_tokens}, "
            f"{_share(self.reusable_tokens, self.prompt_tokens)}), {self.output_tokens} output",
        ]
        if self.has_phases:
            lines.append(
                f"- requests per replica: prefill {_spread(self.prefill_replicas)}; "
                f"decode {_spread(self.decode_replicas)}"
            )
        if self.slo_met is not None:
            lines.append(
                f"- within the SLOs: {self.slo_met} of {self.requests} requests "
                f"({_share(self.slo_met, self.requests)}), "
                f"goodput {self.slo_met / self.duration_s:.2f} requests/s"
            )
        shown = self.percentiles
        pcts = " | ".join(f"p{_pname(p)}" for p in shown)
        lines += ["", f"| latency (ms) | mean | {pcts} |", "|---|---|" + "---|" * len(shown)]
        for name, d in (
            ("time to first token", self.ttft),
            ("time per output token", self.tpot),
            ("inter-token latency", self.itl),
            ("end to end", self.e2e),
        ):
            cells = " | ".join(f"{d.pct[p] * 1e3:.1f}" for p in shown)
            lines.append(f"| {name} | {d.mean * 1e3:.1f} | {cells} |")
        return lines + self._render_phases() if self.has_phases else lines

    def _render_phases(self) -> list[str]:
        lines = [
            "",
            "| phase (mean per request) | ms | share of end to end |",
            "|---|---|---|",
        ]
        for k in PHASES:
            lines.append(f"| {k} | {self.phase_mean_s[k] * 1e3:.1f} | {self.phase_share(k):.1%} |")
        lines.append(
            f"\nDominant phase: **{self.dominant_phase}** "
            f"({self.phase_share(self.dominant_phase):.0%} of the requests' time end to end): "
            + PHASE_HINTS[self.dominant_phase]
        )
        return lines


def _pname(p: float) -> str:
    """A percentile as vLLM names it in its keys: 99 -> "99", 99.9 -> "99.9"."""
    return f"{p:g}"


def _max_concurrent(done: list[RequestRecord]) -> int:
    """The most completed requests in flight at once (sent, last token not yet arrived)."""
    events = sorted([(r.sent_s, 1) for r in done] + [(r.token_times[-1], -1) for r in done])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.1%}" if whole else "n/a"


def _spread(counts: dict[str, int]) -> str:
    return ", ".join(f"{k or '?'} {v}" for k, v in sorted(counts.items())) or "none"
