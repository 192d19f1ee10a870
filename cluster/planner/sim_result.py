"""What a simulated run gives: each request's times (`RequestOutcome`, as a client would see
them, the proxy's cost included) and the run's summary against SLOs (`SimResult.summary`).

A request meets the SLOs when its time to first token is within the TTFT SLO and its mean
inter-token latency after the first token (TPOT, as `vllm bench serve`'s goodput counts it)
within the ITL SLO. Goodput: such requests per second of the run (first arrival to last
token); attainment: their share of all requests (one that never finished misses both).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

PHASES = ("queue", "prefill", "kv_wait", "kv_transfer", "decode")


@dataclass
class RequestOutcome:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    proxy_s: float = 0.0
    enqueued_s: float = math.nan  # reached a prefilling replica's queue
    scheduled_s: float = math.nan  # its first prefill step began
    kv_start_s: float = math.nan  # a decode replica reserved room and the KV began to move
    kv_end_s: float = math.nan
    token_times: list[float] = field(default_factory=list)  # engine times; [0]: first token
    cached_tokens: int = 0
    prefill_replica: str = ""
    decode_replica: str = ""

    @property
    def finished(self) -> bool:
        return len(self.token_times) >= self.output_tokens

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.arrival_s + self.proxy_s

    @property
    def e2e_s(self) -> float:
        return self.token_times[-1] - self.arrival_s + self.proxy_s

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot_s(self) -> float:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0

    def phases(self) -> dict[str, float]:
        first = self.token_times[0]
        moved = not math.isnan(self.kv_start_s)
        return {
            "queue": self.scheduled_s - self.enqueued_s,
            "prefill": first - self.scheduled_s,
            "kv_wait": self.kv_start_s - first if moved else 0.0,
            "kv_transfer": self.kv_end_s - self.kv_start_s if moved else 0.0,
            "decode": self.token_times[-1] - (self.kv_end_s if moved else first),
        }

    def meets(self, slo_ttft_s: float, slo_itl_s: float) -> bool:
        return self.finished and self.ttft_s <= slo_ttft_s and self.tpot_s <= slo_itl_s


@dataclass(frozen=True)
class Summary:
    requests: int
    completed: int
    duration_s: float
    goodput_rps: float
    attainment: float
    ttft_s: dict[str, float]  # mean, p50, p90, p99
    itl_s: dict[str, float]
    tpot_s: dict[str, float]
    phase_mean_s: dict[str, float]
    utilization: dict[str, float]  # pool -> busy share of its replicas' time
    bottleneck: str


def distribution(values: list[float]) -> dict[str, float]:
    if not values:
        return {k: math.nan for k in ("mean", "p50", "p90", "p99")}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass(frozen=True)
class SimResult:
    outcomes: list[RequestOutcome]
    busy_s: dict[str, float]  # pool -> engine seconds spent stepping
    replica_s: dict[str, float]  # pool -> replica seconds available

    def summary(self, slo_ttft_s: float = math.inf, slo_itl_s: float = math.inf) -> Summary:
        done = [o for o in self.outcomes if o.finished]
        start = min((o.arrival_s for o in self.outcomes), default=0.0)
        end = max((o.token_times[-1] + o.proxy_s for o in done), default=start)
        duration = max(end - start, 1e-9)
        good = [o for o in done if o.meets(slo_ttft_s, slo_itl_s)]
        phases = [o.phases() for o in done]
        phase_mean = {
            k: statistics.fmean(p[k] for p in phases) if phases else math.nan for k in PHASES
        }
        util = {pool: self.busy_s[pool] / s if s > 0 else 0.0 for pool, s in self.replica_s.items()}
        return Summary(
            requests=len(self.outcomes),
            completed=len(done),
            duration_s=duration,
            goodput_rps=len(good) / duration,
            attainment=len(good) / len(self.outcomes) if self.outcomes else 0.0,
            ttft_s=distribution([o.ttft_s for o in done]),
            itl_s=distribution([g for o in done for g in o.itl_s]),
            tpot_s=distribution([o.tpot_s for o in done if len(o.token_times) > 1]),
            phase_mean_s=phase_mean,
            utilization=util,
            bottleneck=bottleneck(done, len(self.outcomes), slo_ttft_s, slo_itl_s, util),
        )


def bottleneck(
    done: list[RequestOutcome], total: int, slo_ttft_s: float, slo_itl_s: float, util: dict
) -> str:
    """What limits the run: where SLOs are missed, the phase that most of the missing requests'
    time went to (the TTFT phases for a TTFT miss, the decode phases for an ITL miss; requests
    never finished count as decode); where none is missed, the busiest pool."""
    late_first = [o for o in done if o.ttft_s > slo_ttft_s]
    slow = [o for o in done if o.ttft_s <= slo_ttft_s and o.tpot_s > slo_itl_s]
    unfinished = total - len(done)
    if not late_first and not slow and not unfinished:
        return f"none missed; busiest: {max(util, key=util.get)}" if util else "none missed"
    if len(late_first) >= len(slow) + unfinished:
        spent = {k: sum(o.phases()[k] for o in late_first) for k in ("queue", "prefill")}
        worst = max(spent, key=spent.get)
        return "ttft: prefill queue" if worst == "queue" else "ttft: prefill compute"
    if not slow:
        return "decode: unfinished requests"
    spent = {k: sum(o.phases()[k] for o in slow) for k in ("kv_wait", "kv_transfer", "decode")}
    return f"itl: {max(spent, key=spent.get).replace('_', ' ')}"
