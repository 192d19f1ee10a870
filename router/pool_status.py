"""Each pool's size as Serve sees it, next to the load signal it scales on (`GetStats`)."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from cluster.serving.app_config import AppConfig, PoolConfig
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
    signals: tuple[tuple[str, float, float], ...]  # (name, pool total, target per replica)


@dataclass(frozen=True)
class ClusterStats:
    """What `GetStats` reports: each pool's status and each replica's latest stats (engine
    replicas, and router replicas with their direct gRPC endpoints)."""

    pools: tuple[PoolStatus, ...]
    replicas: tuple[ReplicaStats, ...]
    kv_transport: str = ""  # how KV moves between the pools; "" when colocated


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
        cfg = _pool_config(config, pool)
        low, high = (
            (cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas)
            if cfg.autoscaling is not None
            else (cfg.replicas, cfg.replicas)
        )
        targets = dict(cfg.autoscaling.targets) if cfg.autoscaling is not None else {}
        load = _load([r for r in replicas if r.pool == pool])
        signals = tuple((s, load.get(s, 0.0), t) for s, t in targets.items())
        target = int(d.get("target_num_replicas", 0))
        out.append(PoolStatus(pool, name, running, target, low, high, signals))
    return out


def _pool_config(config: AppConfig, pool: str) -> PoolConfig:
    return {"router": config.router, "prefill": config.prefill}.get(pool, config.decode)


def _load(replicas: list[ReplicaStats]) -> dict[str, float]:
    return {
        "queued_prompt_tokens": float(sum(r.queued_prompt_tokens for r in replicas)),
        "running": float(sum(r.running for r in replicas)),
        "kv_usage": sum(r.kv_blocks_used / max(1, r.kv_blocks_total) for r in replicas),
    }
