"""Per-pool autoscaling on each pool's own load signal.

Request counts are too coarse for an LLM pool: one request may be a 10-token or a 10,000-token
prompt, and a decode replica's capacity is its batch and KV pool, not a request count. So each
engine replica reports its own load to Serve (`record_autoscaling_stats`), and `PoolLoadPolicy`,
running in the Serve controller, turns the pool's summed load into a replica count:

    desired = max over signals s of ceil(sum over replicas of load_s / target_s)

The signals are the fields of `pool_load.LoadSignals`, their one home. Prefill scales on queued
prompt tokens; decode on running sequences and KV cache usage. Serve
then applies min/max bounds and the up/down delays around the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import with_config

from cluster.config import DICT_FORM, ConfigError, NamedNumbers
from cluster.serving.pool_load import SIGNAL_NAMES

POLICY_PATH = "cluster.serving.autoscaling:PoolLoadPolicy"
# The load signals a target may name: the fields of `pool_load.LoadSignals`, what every engine
# replica reports (`EngineReplica.record_autoscaling_stats`), and "requests", Serve's own count
# of a replica's ongoing and queued requests (the only one a router replica has).
ENGINE_SIGNALS = SIGNAL_NAMES
SERVE_SIGNAL = "requests"
SIGNALS = (*ENGINE_SIGNALS, SERVE_SIGNAL)
Targets = Annotated[tuple[tuple[str, float], ...], NamedNumbers(SIGNALS)]


@with_config(DICT_FORM)
@dataclass(frozen=True)
class AutoscalingSettings:
    """Bounds, delays and per-replica targets for one pool. `targets` maps a load signal the
    pool's replicas report (see `EngineReplica.record_autoscaling_stats`) to the amount one
    replica should carry; the special signal "requests" is Serve's own count of ongoing and
    queued requests."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float = 15.0
    targets: Targets = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ConfigError("need 0 <= min_replicas <= max_replicas and max_replicas >= 1")
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ConfigError("initial_replicas must lie between min and max replicas")
        unknown = sorted({s for s, _ in self.targets} - set(SIGNALS))
        if unknown:
            raise ConfigError(f"targets: unknown signals {unknown}; the signals: {SIGNALS}")
        if any(t <= 0 for _, t in self.targets):
            raise ConfigError("autoscaling targets must be positive")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0 or self.look_back_period_s <= 0:
            raise ConfigError("autoscaling delays must be >= 0 and look_back_period_s > 0")

    def serve_config(self) -> dict[str, Any]:
        """The Serve `autoscaling_config` for this pool."""
        config: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": {
                "policy_function": POLICY_PATH,
                "policy_kwargs": {"targets": dict(self.targets)},
            },
        }
        if self.initial_replicas is not None:
            config["initial_replicas"] = self.initial_replicas
        return config


PREFILL_TARGETS = (("queued_prompt_tokens", 2048.0),)
DECODE_TARGETS = (("running", 32.0), ("kv_usage", 0.75))
ROUTER_TARGETS = (("requests", 256.0),)


class PoolLoadPolicy:
    """Serve custom autoscaling policy (instantiated once per deployment in the controller)."""

    def __init__(self, targets: dict[str, float]) -> None:
        self.targets = dict(targets)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        desired = desired_replicas(self.targets, _pool_load(ctx, self.targets))
        if desired is None:  # no signal yet (fresh replicas): hold the current target
            desired = ctx.target_num_replicas
        return desired, ctx.policy_state


def desired_replicas(targets: dict[str, float], load: dict[str, float]) -> int | None:
    """max over the signals present of ceil(load / target); None if no signal is present."""
    wanted = [math.ceil(load[s] / t - 1e-9) for s, t in targets.items() if s in load]
    return max(wanted) if wanted else None


def _pool_load(ctx, targets: dict[str, float]) -> dict[str, float]:
    load: dict[str, float] = {}
    metrics = ctx.aggregated_metrics or {}
    for signal in targets:
        if signal == SERVE_SIGNAL:
            load[signal] = float(ctx.total_num_requests)
        elif metrics.get(signal):
            load[signal] = float(sum(metrics[signal].values()))
    return load
