"""Per-pool autoscaling on each pool's own load signal.

Request counts are too coarse for an LLM pool: one request may be a 10-token or a 10,000-token
prompt, and a decode replica's capacity is its batch and KV pool, not a request count. So each
engine replica reports its own load to Serve (`record_autoscaling_stats`), and `PoolLoadPolicy`,
running in the Serve controller, turns the pool's summed load into a replica count:

    desired = max over signals s of ceil(sum over replicas of load_s / target_s)

The signals are the fields of `pool_load.LoadSignals`, their one home. Prefill scales on queued
prompt tokens; decode on running sequences and KV cache usage. Serve
then applies min/max bounds and the up/down delays around the policy.

Opt-in, `RatioPolicySettings` (`AppConfig.autoscaling.ratio_policy`) sizes the prefill and decode
pools together instead: each pool's policy becomes `cluster.planner.split_policy:SplitPolicy`,
which follows one shared split of `total_replicas` that the planner simulates from the observed
mix (docs/planner.md), and asks the pool's own `PoolLoadPolicy` (`ratio_serve_policy`'s
fallback) whenever that split is not known.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

from pydantic import with_config

from cluster.config import DICT_FORM, ConfigError, NamedNumbers
from cluster.serving.pool_load import SIGNAL_NAMES

POLICY_PATH = "cluster.serving.autoscaling:PoolLoadPolicy"
# Named by import path: the planner plane is loaded by Serve's controller, never imported here.
RATIO_POLICY_PATH = "cluster.planner.split_policy:SplitPolicy"
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


@with_config(DICT_FORM)
@dataclass(frozen=True)
class RatioPolicySettings:
    """The run-time ratio policy: every `interval_s` the planner simulates the mix the pools
    served over the last `window_s` seconds (mean prompt and output lengths, arrival rate) on
    each split of `total_replicas` engine replicas the pools' bounds allow, with `profile`'s
    step times and these SLOs, and both pools follow the best split. With fewer than
    `min_requests` requests in the window, or no usable profile, each pool scales on its own
    signals (`PoolLoadPolicy`). `sim_requests`: the synthetic mix's size (the decision's
    cost)."""

    profile: str
    total_replicas: int
    slo_ttft_ms: float
    slo_itl_ms: float
    interval_s: float = 10.0
    window_s: float = 30.0
    min_requests: int = 8
    sim_requests: int = 48

    def __post_init__(self) -> None:
        if not self.profile:
            raise ConfigError("profile: the path of a planner profile JSON file")
        if self.total_replicas < 2:
            raise ConfigError("total_replicas must be >= 2 (one replica a pool)")
        if not (self.slo_ttft_ms > 0 and self.slo_itl_ms > 0):
            raise ConfigError("slo_ttft_ms and slo_itl_ms must be > 0")
        if not (self.interval_s > 0 and self.window_s >= self.interval_s):
            raise ConfigError("need interval_s > 0 and window_s >= interval_s")
        if self.min_requests < 1 or not 1 <= self.sim_requests <= 1000:
            raise ConfigError("need min_requests >= 1 and sim_requests in 1..1000")

    def check_pools(
        self, mode: str, prefill: AutoscalingSettings | None, decode: AutoscalingSettings | None
    ) -> None:
        """The cross-pool contract, checked once by `AppConfig`: a disaggregated app whose two
        pools autoscale, with bounds some split of `total_replicas` fits."""
        if mode != "disaggregated":
            raise ConfigError("autoscaling.ratio_policy splits a disaggregated app's pools")
        if prefill is None or decode is None:
            raise ConfigError(
                "autoscaling.ratio_policy needs prefill.autoscaling and decode.autoscaling "
                "(their bounds, delays and the signals it falls back to)"
            )
        low = max(prefill.min_replicas, 1) + max(decode.min_replicas, 1)
        high = prefill.max_replicas + decode.max_replicas
        if not low <= self.total_replicas <= high:
            raise ConfigError(
                f"autoscaling.ratio_policy.total_replicas is {self.total_replicas}: the pools' "
                f"bounds split {low}..{high} replicas (prefill {prefill.min_replicas}.."
                f"{prefill.max_replicas}, decode {decode.min_replicas}..{decode.max_replicas})"
            )

    def resolved(self) -> RatioPolicySettings:
        """The profile's path made absolute (Serve's controller has another working directory);
        a missing file is refused when the app is built."""
        path = os.path.abspath(os.path.expanduser(self.profile))
        if not os.path.isfile(path):
            raise ConfigError(f"autoscaling.ratio_policy.profile: no file {path}")
        return replace(self, profile=path)


@with_config(DICT_FORM)
@dataclass(frozen=True)
class AppAutoscaling:
    """Autoscaling across pools (each pool's own is its `autoscaling`)."""

    ratio_policy: RatioPolicySettings | None = None


def ratio_serve_policy(
    ratio: RatioPolicySettings,
    pool: str,
    pool_policy: dict[str, Any],
    bounds: dict[str, tuple[int, int]],
    app_name: str,
    registry: tuple[str, str],
) -> dict[str, Any]:
    """The Serve `policy` of `pool` ("prefill" or "decode") under the ratio policy:
    `SplitPolicy`, falling back to `pool_policy` (the pool's own), fed by the planner actor of
    `app_name`, which polls the stats registry actor `registry` (name, namespace); `bounds`:
    each pool's (min, max) replicas."""
    planner = {
        "app_name": app_name,
        "registry_name": registry[0],
        "registry_namespace": registry[1],
        "profile": ratio.profile,
        "total_replicas": ratio.total_replicas,
        "prefill_bounds": list(bounds["prefill"]),
        "decode_bounds": list(bounds["decode"]),
        "slo_ttft_s": ratio.slo_ttft_ms / 1e3,
        "slo_itl_s": ratio.slo_itl_ms / 1e3,
        "interval_s": ratio.interval_s,
        "window_s": ratio.window_s,
        "min_requests": ratio.min_requests,
        "sim_requests": ratio.sim_requests,
    }
    return {
        "policy_function": RATIO_POLICY_PATH,
        "policy_kwargs": {"pool": pool, "fallback": pool_policy, "planner": planner},
    }


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
