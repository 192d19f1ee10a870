"""How many GPUs an engine replica asks Ray for, decided from the cluster's nodes, never from the
machine that builds the app.

The machine that builds the app is often not one that runs an engine: `pdserve serve --address
auto` on a CPU-only head, or a Serve config built by the controller there. Asking that machine
whether it has a GPU (as the CLI once did) made every engine replica of a GPU cluster ask for
none and run on the CPU in float32, with no warning. So an engine pool's `num_gpus` is a number
or "auto" (its default), and `engine_gpus` decides "auto" from the model's device and a
`ClusterView`: the resources of the live nodes that may hold the pool's replicas (those with
every custom resource it asks for, such as deploy/aws's `prefill_pool`). The device and dtype
themselves each replica decides where it runs (`replica_device`), by the same rule: "auto" is
cuda + bfloat16 exactly when Ray granted the replica a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from cluster.config import ConfigError
from cluster.serving.app_config import ENGINE_POOLS, AppConfig, PoolConfig

log = logging.getLogger("ray.serve." + __name__)
# Node resources that say nothing a pool can ask for, left out of messages.
_HIDDEN = ("memory", "object_store_memory", "node:", "accelerator_type:")


@dataclass(frozen=True)
class ClusterView:
    """The resources of a cluster's live nodes, one mapping per node, in Ray's names (CPU, GPU,
    custom resources). `where` names it in messages."""

    nodes: tuple[Mapping[str, float], ...]
    where: str = "the cluster"

    @classmethod
    def current(cls) -> ClusterView:
        """The connected Ray cluster's live nodes (`ray.nodes()`: in a Serve controller's build
        task, or after `ray.init`); without a connection this machine alone, which a Ray
        started here would be (its cores and the GPUs torch sees)."""
        import ray

        if ray.is_initialized():
            return cls(tuple(dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")))
        import torch

        here = {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}
        return cls((here,), "this machine")

    def hosts(self, resources: Mapping[str, float]) -> tuple[Mapping[str, float], ...]:
        """The nodes that could hold a replica asking for `resources` (custom ones, such as
        `prefill_pool`): those that have at least that much of each."""
        return tuple(n for n in self.nodes if all(n.get(k, 0.0) >= v for k, v in resources.items()))

    def describe(self, nodes: tuple[Mapping[str, float], ...] | None = None) -> str:
        """`nodes` (default: all) as "N nodes: 2 x {CPU: 192, GPU: 8}, 1 x {CPU: 8}"."""
        nodes = self.nodes if nodes is None else nodes
        counts: dict[str, int] = {}
        for node in nodes:
            shown = {k: v for k, v in node.items() if not k.startswith(_HIDDEN)}
            text = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"
            counts[text] = counts.get(text, 0) + 1
        kinds = ", ".join(f"{n} x {text}" for text, n in counts.items())
        return f"{len(nodes)} node{'s' * (len(nodes) != 1)}: {kinds}" if nodes else "no nodes"


def engine_gpus(name: str, pool: PoolConfig, device: str, view: ClusterView) -> float:
    """GPUs one engine process of pool `name` asks Ray for: `pool.num_gpus` if a number, else
    by the model's `device`: cpu none, cuda one, auto one if a node that may hold the pool's
    replicas (`ClusterView.hosts`) has a GPU, else none: each rank's, at tensor parallel size
    k a replica's k ranks on one node.

    Refused with a ConfigError naming the pool, its GPUs and what those nodes have: GPUs asked
    where those nodes have none (Serve would wait for them forever), and "auto" with a device
    of "auto" where no live node has the pool's resources yet (an autoscaler may add one, but
    nothing says whether it will have GPUs: state `num_gpus`). A number or cuda is taken on
    trust there."""
    resources = dict(pool.resources)
    hosts = view.hosts(resources)
    on = f" on nodes with {_format(resources)}" if resources else ""
    if pool.num_gpus != "auto":
        asked = float(pool.num_gpus)
    elif device == "auto":
        if not hosts:
            raise ConfigError(
                f"pool {name}: num_gpus auto, but no node of {view.where} has "
                f"{_format(resources)} yet, so nothing says whether its nodes have GPUs "
                f"({view.describe()}); set {name}.num_gpus"
            )
        return 1.0 if any(n.get("GPU", 0.0) >= 1 for n in hosts) else 0.0
    elif device.startswith("cuda"):
        asked = 1.0
    else:
        return 0.0
    need = asked * pool.tensor_parallel_size  # a replica's ranks share one node
    if asked > 0 and hosts and not any(n.get("GPU", 0.0) >= need for n in hosts):
        raise ConfigError(
            f"pool {name} asks {need:g} GPU per replica{on}, but {view.where} has no node "
            f"with {need:g}: {view.describe(hosts)}"
        )
    return asked


def place_gpus(config: AppConfig, view: ClusterView | None = None) -> AppConfig:
    """`config` with each engine pool's `num_gpus` a number (`engine_gpus`), looking at
    `view` (default: `ClusterView.current()`, read only when some pool may want a GPU).

    Refused as well: device and dtype "auto" in a disaggregated app whose prefill replicas get
    GPUs and decode replicas none (or the reverse). Each would decide its dtype where it runs
    (bfloat16 on a GPU, float32 on the CPU) and every KV transfer would fail on the layouts."""
    pools = ("decode",) if config.mode == "colocated" else ENGINE_POOLS
    device = config.model.device
    if not any(_may_want_gpus(getattr(config, p), device) for p in pools):
        return replace(config, **{p: replace(getattr(config, p), num_gpus=0.0) for p in pools})
    view = view or ClusterView.current()
    gpus = {p: engine_gpus(p, getattr(config, p), device, view) for p in pools}
    given = ", ".join(f"{p} {g:g}" for p, g in gpus.items())
    if device == config.model.dtype == "auto" and len({g > 0 for g in gpus.values()}) > 1:
        raise ConfigError(
            f"model dtype auto: GPUs per replica {given}, so one pool would run bfloat16 on "
            "GPUs and the other float32 on CPUs, and their KV layouts differ; set model.dtype, "
            f"or each pool's num_gpus ({view.describe()})"
        )
    if device == "auto":  # said where the app is built; each replica then decides by its grant
        log.info("GPUs per engine replica: %s (%s: %s)", given, view.where, view.describe())
    return replace(config, **{p: replace(getattr(config, p), num_gpus=g) for p, g in gpus.items()})


def _may_want_gpus(pool: PoolConfig, device: str) -> bool:
    if pool.num_gpus == "auto":
        return not device.startswith("cpu")
    return pool.num_gpus > 0


def _format(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
