"""Where a tensor-parallel replica's ranks 1..k-1 run (`TPReplica`'s launcher).

- `LocalRanks` (the default, and outside Ray): `multiprocessing` spawn children of this process,
  on this machine; rank `r` of a GPU replica uses `cuda:r` of the GPUs this process sees.
- `BundleRanks` (a served replica whose deployment reserves a placement group of k bundles):
  rank `r` is a Ray actor of its own in bundle `r`, with that bundle's CPUs and GPU (so
  Ray's `CUDA_VISIBLE_DEVICES` gives it one GPU, `cuda:0`), on whichever node holds the bundle.
  The actors are owned by the replica's actor: if it dies, Ray ends them too. Each appears in
  the Ray dashboard as a `TPRank` actor of the replica's placement group.

Both hand back one `Rank` per follower with the same surface: `pid`, `node_id`, `node_ip`,
`is_alive()`, `join(timeout)`, `terminate()`. The follower's work is the same function either
way (`tp_replica._follower`), run to its end: a local process's target, an actor's `run` call.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import torch


class LocalRank:
    """A follower as a spawn child of this process."""

    def __init__(self, target: Callable, args: tuple) -> None:
        self._process = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        self._process.start()
        self.pid = self._process.pid
        self.node_id, self.node_ip = "", ""  # this process's node: the caller knows it

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def join(self, timeout: float | None) -> None:
        self._process.join(timeout)

    def terminate(self) -> None:
        self._process.terminate()
        self._process.join(5.0)


class LocalRanks:
    """Followers as local processes; `gpu_index(rank)` is the rank's GPU among ours."""

    host = "127.0.0.1"

    def start(self, target: Callable, rank: int, args: tuple) -> LocalRank:
        return LocalRank(target, (rank, *args))

    def gpu_index(self, rank: int) -> int:
        return rank


class _TPRank:
    """A follower rank's Ray actor: `where` answers while `run` runs (two threads)."""

    def where(self) -> tuple[int, str, str]:
        import ray

        context = ray.get_runtime_context()
        return os.getpid(), context.get_node_id(), ray.util.get_node_ip_address()

    def run(self, target: Callable, args: tuple) -> None:
        target(*args)


@functools.cache
def _rank_actor_class():
    import ray

    return ray.remote(_TPRank)


class ActorRank:
    """A follower as a Ray actor in its bundle; alive while its `run` call is."""

    def __init__(self, actor: Any, run: Any, where: tuple[int, str, str]) -> None:
        self._actor, self._run = actor, run
        self.pid, self.node_id, self.node_ip = where

    def is_alive(self) -> bool:
        import ray

        done, _ = ray.wait([self._run], timeout=0)
        return not done

    def join(self, timeout: float | None) -> None:
        """Wait for the rank's work to end; then end its actor too (its worker process and
        its hold on the bundle)."""
        import ray

        done, _ = ray.wait([self._run], timeout=timeout)
        if done:
            ray.kill(self._actor, no_restart=True)

    def terminate(self) -> None:
        import ray

        ray.kill(self._actor, no_restart=True)
        ray.wait([self._run], timeout=5.0)


class BundleRanks:
    """Followers as Ray actors, rank `r` in bundle `r` of `placement_group`, each with
    `bundles[r]`'s CPUs and GPUs. `host`: this node's address, which every rank can reach
    (the bundles may lie on other nodes when the group's strategy allows it)."""

    def __init__(self, placement_group: Any, bundles: list[dict[str, float]], start_timeout_s=300):
        import ray

        self.placement_group = placement_group
        self.bundles = bundles
        self.start_timeout_s = start_timeout_s
        self.host = ray.util.get_node_ip_address()

    @classmethod
    def of_current_group(cls, k: int) -> BundleRanks | None:
        """For a Ray actor placed in a placement group of at least `k` bundles (a served TP
        replica), that group's launcher; None elsewhere (a test, a driver)."""
        import ray
        from ray.util import get_current_placement_group

        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return None
        group = get_current_placement_group()
        if group is None or len(group.bundle_specs) < k:
            return None
        return cls(group, [dict(b) for b in group.bundle_specs])

    def start(self, target: Callable, rank: int, args: tuple) -> ActorRank:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[rank]
        others = {
            name: amount for name, amount in bundle.items() if name not in ("CPU", "GPU", "memory")
        }
        actor = (
            _rank_actor_class()
            .options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                resources=others or None,
                max_concurrency=2,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank
                ),
            )
            .remote()
        )
        where = ray.get(actor.where.remote(), timeout=self.start_timeout_s)
        return ActorRank(actor, actor.run.remote(target, (rank, *args)), where)

    def gpu_index(self, rank: int) -> int:
        return 0  # Ray gives each rank's actor its bundle's one GPU


def local_device(device: torch.device, gpu_index: int) -> torch.device:
    """A follower's device: `cuda:<gpu_index>` on a GPU replica, else `device`."""
    if device.type != "cuda":
        return device
    device = torch.device("cuda", gpu_index)
    torch.cuda.set_device(device)
    return device
