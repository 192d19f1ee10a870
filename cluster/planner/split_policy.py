"""`SplitPolicy`: a pool's Serve autoscaling policy under the ratio policy
(`AppConfig.autoscaling.ratio_policy`). Serve's controller makes one per pool (prefill,
decode); both follow the split their application's `SplitPlanner` decided, so the two pools
are sized together from one decision, and each asks its own per-pool policy (the `fallback`,
`cluster.serving.autoscaling:PoolLoadPolicy`, named by import path as Serve names policies)
whenever the planner has no decision: too few requests observed, no usable profile, the
planner not answering. Serve applies the pool's bounds and delays around either answer.

Serve's application-level `autoscaling_policy` (one policy for all of an app's deployments)
is not used: Ray 2.60 takes it only from a Serve config file, not from `serve.run`, which
`pdserve serve` and the tests deploy with, and it would run the simulator on the
controller's loop. Here the controller never waits: the policy reads the planner's state
with a call it collects on a later tick (`POLL_S` apart), and a state older than
`STALE_INTERVALS` decision intervals counts as none.
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

import ray

from cluster.planner.split_planner import PlannerSettings, PlannerState, planner_handle

log = logging.getLogger("ray.serve." + __name__)
POLL_S = 0.5
RETRY_S = 10.0  # after the planner failed, how long to stay on the pool's own signals
STALE_INTERVALS = 3.0
POOLS = ("prefill", "decode")


def load_policy(spec: dict[str, Any]):
    """A Serve `policy` dict's callable: `policy_function` ("module:name"), a class made with
    `policy_kwargs`, or a plain function."""
    module, _, name = spec["policy_function"].partition(":")
    target = getattr(importlib.import_module(module), name)
    return target(**spec.get("policy_kwargs", {})) if isinstance(target, type) else target


class SplitPolicy:
    def __init__(self, pool: str, fallback: dict[str, Any], planner: dict[str, Any]) -> None:
        if pool not in POOLS:
            raise ValueError(f"SplitPolicy sizes {POOLS}, not {pool!r}")
        self.pool = pool
        self.fallback = load_policy(fallback)
        self.settings = PlannerSettings.of(planner)
        self._planner = None
        self._pending = None
        self._asked_at = -POLL_S
        self._retry_at = 0.0
        self.state: PlannerState | None = None
        self._followed = ""  # the split last followed, for the log

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        desired, state = self.fallback(ctx)
        replicas = self.split_replicas(time.monotonic())
        if replicas is None:
            if self._followed:
                log.info("%s pool back on its own signals", self.pool)
                self._followed = ""
            return desired, state
        return replicas, state

    def split_replicas(self, now: float) -> int | None:
        """This pool's replicas in the planner's current split, None without one."""
        self._poll(now)
        s = self.state
        fresh = s is not None and time.time() - s.updated_at < (
            STALE_INTERVALS * self.settings.interval_s
        )
        if not fresh or s is None or s.decision is None:
            return None
        d = s.decision
        if d.split != self._followed:
            log.info("%s pool follows the ratio policy's %s", self.pool, d.split)
            self._followed = d.split
        return d.prefill_replicas if self.pool == "prefill" else d.decode_replicas

    def _poll(self, now: float) -> None:
        if now < self._retry_at:
            return
        try:
            if self._planner is None:
                self._planner = planner_handle(self.settings)
                self._planner.configure.remote(self.settings)
            if self._pending is not None:
                ready, _ = ray.wait([self._pending], timeout=0)
                if not ready:
                    return
                pending, self._pending = self._pending, None
                self.state = ray.get(pending)
            if now - self._asked_at >= POLL_S:
                self._pending = self._planner.read.remote()
                self._asked_at = now
        except Exception as e:  # the planner gone: ask again next time, own signals meanwhile
            log.warning("%s pool: ratio policy planner unavailable (%s)", self.pool, e)
            self._planner = self._pending = self.state = None
            self._retry_at = now + RETRY_S
