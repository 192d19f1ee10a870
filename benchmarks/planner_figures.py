"""The planner benchmark's comparisons: the same figures from a measured replay (the client's
records and each response's `timing`) and from the simulator's run of the same requests, and
the goodput and attainment both give under SLOs.

Phases, measured <- simulated (seconds, means over the finished requests):
- queue: `timing.queue` (waiting for the engine's admission) <- `queue` (enqueued to the first
  prefill step);
- prefill: `timing.prefill` (admission to the first token on the prefilling replica) <-
  `prefill`;
- kv_transfer: `timing.kv_transfer` <- `kv_transfer` (disaggregated only);
- decode: the server's total less its TTFT and KV transfer (`phase_seconds`) <- `kv_wait` +
  `decode` (the wait for a decode slot is inside the measured decode time).
TTFT, ITL and TPOT p90 are the client's (first token after sending; every gap between token
arrivals; a request's mean gap after its first token) against the simulator's, which adds the
profile's proxy and routing overheads.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from cluster.client.bench_summary import percentile, phase_seconds
from cluster.client.load_generator import RequestRecord
from cluster.planner.sim_result import SimResult

PHASE_FIGURES = ("queue", "prefill", "kv_transfer", "decode")
P90_FIGURES = ("TTFT p90", "ITL p90", "TPOT p90")
BOUNDS = {**dict.fromkeys(PHASE_FIGURES, 0.25), **dict.fromkeys(P90_FIGURES, 0.35)}


def measured_figures(records: list[RequestRecord]) -> dict[str, float]:
    """`BOUNDS`' figures (seconds) of a measured replay's finished requests."""
    done = [r for r in records if r.ok and r.timing is not None and r.token_times]
    phases = [phase_seconds(r) for r in done]
    out = {k: statistics.fmean(p[k] for p in phases) if phases else math.nan for k in PHASE_FIGURES}
    out["TTFT p90"] = percentile([r.ttft_s for r in done], 90)
    out["ITL p90"] = percentile([g for r in done for g in r.itl_s], 90)
    out["TPOT p90"] = percentile([r.tpot_s for r in done if r.tpot_s is not None], 90)
    return out


def predicted_figures(result: SimResult) -> dict[str, float]:
    """`BOUNDS`' figures (seconds) of a simulated run."""
    s = result.summary()
    ph = s.phase_mean_s
    out = {k: ph[k] for k in ("queue", "prefill", "kv_transfer")}
    out["decode"] = ph["kv_wait"] + ph["decode"]
    out["TTFT p90"], out["ITL p90"] = s.ttft_s["p90"], s.itl_s["p90"]
    out["TPOT p90"] = s.tpot_s["p90"]
    return out


@dataclass(frozen=True)
class Comparison:
    figure: str
    predicted_s: float
    measured_s: float

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s if self.measured_s > 0 else math.nan

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1.0) <= BOUNDS[self.figure]  # False when nan


def compare(predicted: dict[str, float], measured: dict[str, float], mode: str) -> list[Comparison]:
    """One comparison per figure; no KV transfer for a colocated app (both are 0)."""
    figures = [f for f in BOUNDS if not (f == "kv_transfer" and mode == "colocated")]
    return [Comparison(f, predicted[f], measured[f]) for f in figures]


def measured_goodput(
    records: list[RequestRecord], slo_ttft_s: float, slo_itl_s: float
) -> tuple[float, float]:
    """(goodput in requests/s, attainment) of a measured replay, as `SimResult.summary` counts
    them: a request meets the SLOs when it finished with TTFT and TPOT within them; the run
    lasts from the first arrival to the last token."""
    done = [r for r in records if r.ok and r.token_times]
    good = [r for r in done if r.ttft_s <= slo_ttft_s and (r.tpot_s or 0.0) <= slo_itl_s]
    start = min((r.scheduled_s for r in records), default=0.0)
    end = max((r.token_times[-1] for r in done), default=start)
    return len(good) / max(end - start, 1e-9), len(good) / max(1, len(records))
