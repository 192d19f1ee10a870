"""Each pool's size as Serve sees it, next to the load signal it scales on (`GetStats`)."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from cluster.planner.split_planner import PlannerState
from cluster.serving.app_config import AppConfig, DeploymentConfig
from cluster.serving.autoscaling import SERVE_SIGNAL
from cluster.serving.pool_load import pool_load
from cluster.serving.pool_messages import ReplicaStats

# Serve deployment name -> pool name
DEPLOYMENT_POOLS = {
    "Router": "router",
    "Prefill": "prefill",
    "Decode": "decode",
    "Colocated": "colocated",
}


@dataclass(frozen=True)
class PoolStatus:
    pool: str
    deployment: str
    current_replicas: int
    target_replicas: int
    min_replicas: int
    max_replicas: int
    # (name, pool total, target per replica) for each target the pool scales on, but Serve's
    # own "requests": only Serve's controller counts a replica's requests.
    signals: tuple[tuple[str, float, float], ...]


@dataclass(frozen=True)
class ClusterStats:
    """What `GetStats` reports: each pool's status and each replica's latest stats (engine
    replicas, and router replicas with their direct gRPC endpoints)."""

    pools: tuple[PoolStatus, ...]
    replicas: tuple[ReplicaStats, ...]
    kv_transport: str = ""  # how KV moves between the pools; "" when colocated
    ratio_policy: PlannerState | None = None  # with `autoscaling.ratio_policy` on


def kv_transport(config: AppConfig) -> str:
    """The KV transport the app was built with ("auto" was decided then)."""
    return "" if config.mode == "colocated" else config.transfer.transport


async def pool_statuses(
    config: AppConfig, app_name: str, replicas: list[ReplicaStats]
) -> list[PoolStatus]:
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    details = await controller.get_serve_instance_details.remote()
    deployments = details.get("applications", {}).get(app_name, {}).get("deployments", {})
    out = []
    for name, pool in DEPLOYMENT_POOLS.items():
        d = deployments.get(name)
        if d is None:
            continue
        running = sum(1 for r in d.get("replicas", []) if r.get("state") == "RUNNING")
        cfg = config.pool(pool)
        low, high = (
            (cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas)
            if cfg.autoscaling is not None
            else (cfg.replicas, cfg.replicas)
        )
        signals = pool_signals(cfg, [r for r in replicas if r.pool == pool])
        target = int(d.get("target_num_replicas", 0))
        out.append(PoolStatus(pool, name, running, target, low, high, signals))
    return out


def pool_signals(
    pool: DeploymentConfig, replicas: list[ReplicaStats]
) -> tuple[tuple[str, float, float], ...]:
    """(signal, the pool's total, target per replica) for each autoscaling target of `pool`,
    the totals summed over `replicas` (`pool_load`); Serve's own "requests" is left out (only
    Serve's controller counts them). A target naming no load signal raises KeyError."""
    if pool.autoscaling is None:
        return ()
    load = pool_load(replicas)
    return tuple((s, load.value(s), t) for s, t in pool.autoscaling.targets if s != SERVE_SIGNAL)
