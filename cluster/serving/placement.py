"""Whether an app's deployments fit a Ray cluster, and a bounded wait until they run.

Serve never gives up on a replica it cannot place: it logs that the replica "has taken more than
30s to be scheduled" and waits, forever. `pdserve serve` instead sizes the local Ray it starts
for the replicas asked for (`local_cpus`), refuses at once what that Ray cannot hold
(`check_fits`: GPUs, custom resources), refuses a tensor-parallel replica that no node can hold
(`check_tp_groups`: its ranks share one node) and waits a bounded time for every application to
run (`wait_running`), ending with a message that names the pool, what one replica needs and what
the cluster has.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cluster.errors import FailedPrecondition, ResourceExhausted
from cluster.serving.app import deployment_pools
from cluster.serving.app_config import AppConfig
from cluster.serving.gpu_placement import ClusterView

# A local Ray gets at least this many logical CPUs, so the three deployments fit a small
# machine (Ray's CPUs are a count for placement, not a limit on threads).
MIN_LOCAL_CPUS = 4


@dataclass(frozen=True)
class Demand:
    """What one deployment asks of the cluster: `replicas` (its most, when autoscaling) of
    `per_replica` Ray resources each, all on one node when the replica spans
    `tensor_parallel_size` > 1 ranks."""

    app: str
    deployment: str
    pool: str
    replicas: int
    per_replica: dict[str, float]
    tensor_parallel_size: int = 1

    def describe(self) -> str:
        each = _format(self.per_replica)
        k = self.tensor_parallel_size
        ranks = f" (tensor_parallel_size {k}: {k} ranks on one node)" if k > 1 else ""
        return f"pool {self.pool} (deployment {self.deployment}): {self.replicas} x {each}{ranks}"


def demands(config: AppConfig) -> list[Demand]:
    """Each deployment's demand, in deployment order (router first). GPUs count once they
    are a number (`gpu_placement.place_gpus`), not while "auto". A replica of tensor parallel
    size k asks for k ranks' CPUs and GPUs (`PoolConfig.serve_placement`)."""
    out = []
    for name, pool_name in deployment_pools(config).items():
        pool = getattr(config, pool_name)
        size = pool.autoscaling.max_replicas if pool.autoscaling else pool.replicas
        k = getattr(pool, "tensor_parallel_size", 1)
        gpus = pool.num_gpus if pool.num_gpus == "auto" else pool.num_gpus * k
        per = {"CPU": pool.num_cpus * k, "GPU": gpus, **dict(pool.resources)}
        per = {k: float(v) for k, v in per.items() if v and v != "auto"}
        out.append(Demand(config.name, name, pool_name, size, per, k))
    return out


def local_cpus(configs: list[AppConfig]) -> int:
    """Logical CPUs for a local Ray that must hold every replica of `configs` at their largest:
    the machine's cores, at least `MIN_LOCAL_CPUS`, more when the replicas ask for more (their
    engine threads then share cores, as they would in fractional CPUs)."""
    need = sum(d.replicas * d.per_replica.get("CPU", 0.0) for c in configs for d in demands(c))
    return max(MIN_LOCAL_CPUS, os.cpu_count() or 1, math.ceil(need - 1e-9))


def check_fits(configs: list[AppConfig], cluster: Mapping[str, float]) -> None:
    """Refuse an app whose replicas together need more of a resource than `cluster`
    (`ray.cluster_resources()`) holds, naming the pools that ask for it and what the cluster
    has. For a Ray that cannot grow: a joined cluster's autoscaler may add nodes."""
    all_demands = [d for c in configs for d in demands(c)]
    total: dict[str, float] = {}
    for d in all_demands:
        for key, amount in d.per_replica.items():
            total[key] = total.get(key, 0.0) + d.replicas * amount
    for key, need in total.items():
        if need > cluster.get(key, 0.0) + 1e-9:
            askers = "; ".join(d.describe() for d in all_demands if key in d.per_replica)
            raise ResourceExhausted(
                f"{askers}: {need:g} {key} in all, the cluster has {_format(_known(cluster))}"
            )


def check_tp_groups(configs: list[AppConfig], view: ClusterView) -> None:
    """Refuse a pool whose tensor-parallel replicas no live node can hold: a replica's k ranks'
    bundles are placed on one node (STRICT_PACK), so some node with the pool's custom resources
    must have k ranks' CPUs and GPUs at once (Serve would wait for one forever). The message
    names the pool, k, what one replica needs and what those nodes have. Where no live node has
    the pool's custom resources yet nothing is refused (an autoscaler may add one), as
    `gpu_placement.engine_gpus` takes GPUs on trust there."""
    for d in (d for c in configs for d in demands(c) if d.tensor_parallel_size > 1):
        custom = {k: v for k, v in d.per_replica.items() if k not in ("CPU", "GPU")}
        hosts = view.hosts(custom)
        if hosts and not view.hosts(d.per_replica):
            on = f" with {_format(custom)}" if custom else ""
            raise ResourceExhausted(
                f"pool {d.pool}: a replica of tensor_parallel_size {d.tensor_parallel_size} "
                f"needs {_format(d.per_replica)} on one node (a bundle per rank, STRICT_PACK), "
                f"but no node of {view.where}{on} has that: {view.describe(hosts)}"
            )


def wait_running(
    apps: Mapping[str, AppConfig | None], timeout_s: float, poll_s: float = 1.0
) -> None:
    """Wait until every application in `apps` (name -> its config, None for one that is not
    pdserve's) is RUNNING. A failed deploy raises FailedPrecondition with each failed
    deployment's last message line; one still not running after `timeout_s` raises
    ResourceExhausted naming each deployment short of replicas, what one replica needs and
    what the cluster has (and has free)."""
    import ray
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    failed = (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY)
    deadline = time.monotonic() + timeout_s
    while True:
        # Statuses change in the controller's loop: right after a deploy an app that is being
        # replaced can still read RUNNING, so look only after a pause.
        time.sleep(poll_s)
        statuses = serve.status().applications
        for name in apps:
            app = statuses.get(name)
            if app is not None and app.status in failed:
                raise FailedPrecondition(f"application {name!r} failed: {_failure(app)}")
        if all(n in statuses and statuses[n].status == ApplicationStatus.RUNNING for n in apps):
            return
        if time.monotonic() > deadline:
            short = _short(apps, statuses)
            raise ResourceExhausted(
                f"not running after {timeout_s:.0f}s: {'; '.join(short) or 'waiting for Serve'}; "
                f"the cluster has {_format(_known(ray.cluster_resources()))} "
                f"({_format(_known(ray.available_resources()))} free)"
            )


def _short(apps: Mapping[str, AppConfig | None], statuses) -> list[str]:
    """One line per deployment not yet HEALTHY: its demand and its replicas running."""
    from ray.serve.schema import DeploymentStatus

    lines = []
    for name, config in apps.items():
        app = statuses.get(name)
        deployments = app.deployments if app is not None else {}
        by_name = {d.deployment: d for d in demands(config)} if config else {}
        for dep, status in deployments.items():
            if status.status == DeploymentStatus.HEALTHY:
                continue
            running = sum(
                n for s, n in status.replica_states.items() if getattr(s, "value", s) == "RUNNING"
            )
            what = by_name[dep].describe() if dep in by_name else f"deployment {dep}"
            lines.append(f"{what} asked, {running} running")
    return lines


def _failure(app) -> str:
    """The last line of each failed deployment's message (where Serve puts the exception)."""
    from ray.serve.schema import DeploymentStatus

    lines = []
    for dep, status in app.deployments.items():
        if status.status in (DeploymentStatus.DEPLOY_FAILED, DeploymentStatus.UNHEALTHY):
            last = [line for line in status.message.strip().splitlines() if line.strip()]
            lines.append(f"{dep}: {last[-1].strip() if last else status.status}")
    return "; ".join(lines) or app.message.strip().splitlines()[-1]


def _known(resources: Mapping[str, float]) -> dict[str, float]:
    """The resources a pool can ask for (Ray also counts memory, object store, node ids)."""
    skip = ("memory", "object_store_memory")
    return {k: v for k, v in resources.items() if k not in skip and not k.startswith("node:")}


def _format(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
