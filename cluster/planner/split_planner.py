"""`SplitPlanner`: the one place an application's prefill:decode split is decided at run time,
a Ray actor named after the application (`planner_name`). Both pools' `SplitPolicy`s (in
Serve's controller) read its `PlannerState`, so they follow one decision, and the simulator
never runs on the controller's loop.

Every `interval_s` it polls the stats registry (each engine replica's running counters, see
`mix_window`), and, once the window holds `min_requests` requests, decides the split
(`split_decision.SplitCache`, in a thread, so polls and reads go on meanwhile). Each change of
split is logged, one line with the mix, the rate and the predicted goodput. With no usable
profile, or too few requests, the state holds no decision and each pool scales on its own
signals. Nobody reading its state for `IDLE_S` (the app deleted): it stops polling until
read again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray

from cluster.planner.mix_window import MixWindow, ReplicaCounters
from cluster.planner.profile import Profile
from cluster.planner.split_decision import SplitCache, SplitDecision, SplitSearch

log = logging.getLogger("ray.serve." + __name__)
NAMESPACE = "pdserve"
HISTORY = 16  # decisions kept for `pdserve status`
IDLE_S = 120.0
HEAD_NODE_RESOURCE = "node:__internal_head__"  # where Serve's controller runs


def planner_name(app_name: str) -> str:
    return f"pdserve-split-{app_name}"


@dataclass(frozen=True)
class PlannerSettings:
    """What one application's planner needs: the stats registry actor to poll, the profile,
    the search (`SplitSearch`'s fields) and its timing. The Serve policy's JSON kwargs."""

    app_name: str
    registry_name: str
    registry_namespace: str
    profile: str
    total_replicas: int
    prefill_bounds: tuple[int, int]
    decode_bounds: tuple[int, int]
    slo_ttft_s: float
    slo_itl_s: float
    interval_s: float
    window_s: float
    min_requests: int
    sim_requests: int

    @staticmethod
    def of(kwargs: dict[str, Any]) -> PlannerSettings:
        d = dict(kwargs)
        d["prefill_bounds"] = tuple(d["prefill_bounds"])
        d["decode_bounds"] = tuple(d["decode_bounds"])
        return PlannerSettings(**d)

    def search(self) -> SplitSearch:
        return SplitSearch(
            self.total_replicas,
            self.prefill_bounds,
            self.decode_bounds,
            self.slo_ttft_s,
            self.slo_itl_s,
            self.sim_requests,
        )


@dataclass(frozen=True)
class PlannerState:
    """What the planner knows as of `updated_at` (wall clock): the split to follow, or None
    (`reason` says why: the pools then scale on their own signals); the last `HISTORY`
    decisions, oldest first, each with when it was made."""

    decision: SplitDecision | None
    reason: str
    updated_at: float
    history: tuple[tuple[float, SplitDecision], ...] = ()


class SplitRounds:
    """The planner's rounds without Ray: one `round` per poll, a function of the polls so far.
    Not thread-safe: one round at a time."""

    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings
        self.window = MixWindow(settings.window_s)
        self.history: deque[tuple[float, SplitDecision]] = deque(maxlen=HISTORY)
        self.state = PlannerState(None, "no observation yet", time.time())
        self.cache: SplitCache | None = None
        try:
            self.cache = SplitCache(Profile.load(settings.profile), settings.search())
        except ValueError as e:
            log.error("ratio policy off, the pools scale on their own signals: %s", e)
            self.state = PlannerState(None, f"no profile: {e}", time.time())

    def round(self, now: float, replicas: list[ReplicaCounters]) -> PlannerState:
        """Add the poll at `now` (monotonic seconds) and decide; returns the new state."""
        self.window.add(now, replicas)
        mix = self.window.observation(now)
        history = tuple(self.history)
        if self.cache is None:
            self.state = PlannerState(None, self.state.reason, time.time(), history)
        elif mix.requests < self.settings.min_requests:
            reason = (
                f"{mix.requests} requests in the last {mix.span_s:.0f} s (fewer than "
                f"{self.settings.min_requests}): each pool on its own signals"
            )
            self.state = PlannerState(None, reason, time.time(), history)
        else:
            decision = self.cache.decide(mix)
            last = self.history[-1][1] if self.history else None
            if last is None or last.split != decision.split:
                log.info("ratio policy: %s", decision.describe())
                self.history.append((time.time(), decision))
            self.state = PlannerState(decision, "simulated", time.time(), tuple(self.history))
        return self.state


@ray.remote(num_cpus=0)
class SplitPlanner:
    def __init__(self, settings: PlannerSettings) -> None:
        if not logging.getLogger().handlers:  # a plain Ray actor: Serve set up no logging here
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        self._task: asyncio.Task | None = None
        self._read_at = time.monotonic()
        self.rounds = SplitRounds(settings)

    def configure(self, settings: PlannerSettings) -> None:
        """Take `settings` (a redeployed app's); a changed one starts afresh."""
        if self.rounds.settings != settings:
            self.rounds = SplitRounds(settings)

    async def read(self) -> PlannerState:
        """The latest state (starts polling if it was not)."""
        self._read_at = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self.rounds.state

    async def _run(self) -> None:
        while time.monotonic() - self._read_at < IDLE_S:
            began = time.monotonic()
            rounds = self.rounds
            try:
                registry = ray.get_actor(
                    rounds.settings.registry_name, namespace=rounds.settings.registry_namespace
                )
            except ValueError:  # no engine replica has reported yet
                registry = None
            try:
                replicas = [] if registry is None else await registry.list.remote()
                replicas = [counters(r) for r in replicas]
                # The simulator off the actor's loop: reads answer meanwhile.
                await asyncio.to_thread(rounds.round, time.monotonic(), replicas)
            except Exception:  # a failed round leaves the last state, the next one retries
                log.exception("ratio policy: decision round failed")
            await asyncio.sleep(max(0.0, began + rounds.settings.interval_s - time.monotonic()))


def counters(stats: Any) -> ReplicaCounters:
    """A registry entry's (`cluster.serving.pool_messages.ReplicaStats`) running counters."""
    return ReplicaCounters(
        stats.pool, stats.replica_id, stats.generated_tokens, stats.prompt_tokens
    )


def planner_handle(settings: PlannerSettings):
    """The application's planner, made by whichever pool's policy asks first, on the head
    node beside Serve's controller, which owns it (it goes with Serve)."""
    return SplitPlanner.options(
        name=planner_name(settings.app_name),
        namespace=NAMESPACE,
        get_if_exists=True,
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(settings)


async def planner_state(app_name: str) -> PlannerState | None:
    """The application's planner's state, for `GetStats`; None before any pool's policy
    made the planner."""
    try:
        planner = ray.get_actor(planner_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None
    return await planner.read.remote()
