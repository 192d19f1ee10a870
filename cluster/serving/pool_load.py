"""A replica's load: the one home of the signals a pool scales on.

`LoadSignals.of` turns one engine replica's `ReplicaStats` into its load signals, and everything
that shows or uses load reads them from there: Serve's autoscaler (`EngineReplica.
record_autoscaling_stats` -> `autoscaling.PoolLoadPolicy`), the Prometheus gauges
(`EngineReplica._report` sets `LoadSignals.gauges`; `metrics.METRICS` declares them from
`GAUGES`) and `GetStats` (`router/pool_status.py` sums a pool's replicas with `pool_load` and
reads each configured target with `LoadSignals.value`, which refuses a name it does not hold
instead of reading 0). The names a target may use (`autoscaling.SIGNALS`) are this dataclass's
fields.

Adding a signal (the dry run; `tests/cluster/serving/test_pool_load.py` proves each field
reaches all three):
1. here: a field with its gauge (`_gauge(name, description)`) and its value in `of`;
2. if it needs a figure the engine does not report yet: that figure in `EngineStats`
   (`cluster/engine/engine.py`) and
3. in `ReplicaStats` (`pool_messages.py`; `EngineReplica.stats` copies every engine figure).
Nothing else changes: config validation, the policy, the gauges, `GetStats` and `pdserve status`
read the field list.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the autoscaling policy imports this without torch
    from cluster.serving.pool_messages import ReplicaStats


def _gauge(name: str, description: str) -> Any:
    """A signal field, exported as the Prometheus gauge `name` (tagged with the pool)."""
    return field(default=0.0, metadata={"gauge": name, "description": description})


@dataclass(frozen=True)
class LoadSignals:
    """One engine replica's load, or (`pool_load`) a pool's: each field a signal a pool may
    scale on, summed over the pool's replicas."""

    queued_prompt_tokens: float = _gauge(
        "pdserve_queued_prompt_tokens",
        "Prompt tokens still to prefill (cached prefixes not counted)",
    )
    running: float = _gauge("pdserve_running_sequences", "Sequences in the running batch")
    kv_usage: float = _gauge(
        "pdserve_kv_cache_usage", "Used share of the replica's KV blocks (0-1)"
    )

    @classmethod
    def of(cls, s: ReplicaStats) -> LoadSignals:
        """The load signals of one engine replica's stats."""
        return cls(
            queued_prompt_tokens=float(s.queued_prompt_tokens),
            running=float(s.running),
            kv_usage=s.kv_blocks_used / max(1, s.kv_blocks_total),
        )

    def as_dict(self) -> dict[str, float]:
        """Signal name -> value: what Serve's autoscaler is given."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def gauges(self) -> dict[str, float]:
        """Gauge name -> value: what the metrics show."""
        return {f.metadata["gauge"]: getattr(self, f.name) for f in fields(self)}

    def value(self, signal: str) -> float:
        """The value of `signal`; KeyError for a name that is not a signal here."""
        if signal not in SIGNAL_NAMES:
            raise KeyError(f"{signal!r} is not a replica load signal ({SIGNAL_NAMES})")
        return getattr(self, signal)


SIGNAL_NAMES: tuple[str, ...] = tuple(f.name for f in fields(LoadSignals))
# gauge name -> description, for `metrics.METRICS`
GAUGES: dict[str, str] = {
    f.metadata["gauge"]: f.metadata["description"] for f in fields(LoadSignals)
}


def pool_load(replicas: list[ReplicaStats]) -> LoadSignals:
    """The load of a pool: each signal summed over its replicas' stats."""
    each = [LoadSignals.of(r) for r in replicas]
    return LoadSignals(**{n: sum(getattr(s, n) for s in each) for n in SIGNAL_NAMES})
