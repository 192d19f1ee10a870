"""`grpc.health.v1.Health/Check` (proto/grpc/health/v1/health.proto) for the router: whether
this app can serve a generation now.

SERVING when every engine pool the app needs has a running replica (disaggregated: prefill and
decode; colocated: its one pool), NOT_SERVING otherwise (a pool scaled to zero or with every
replica dead or starting). The answer covers the whole server ("") and each service it serves
by full name; any other name is NOT_FOUND, as the protocol says. `Watch` is not served
(UNIMPLEMENTED, which the protocol allows): probes such as `grpc_health_probe` and Kubernetes'
gRPC probes call `Check`.

Pool sizes come from Serve's controller (`pool_statuses`), one call per `CACHE_S` at most
however many probes arrive: callers within that time share one answer (and one call in flight),
so a flood of probes costs the controller nothing more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from cluster.errors import NotFound
from cluster.pb.grpc.health.v1 import health_pb2 as health_pb
from router.pool_status import pool_statuses

SERVICES = ("", "pdserve.v1.Generation", "grpc.health.v1.Health")
CACHE_S = 1.0
SERVING = health_pb.HealthCheckResponse.SERVING
NOT_SERVING = health_pb.HealthCheckResponse.NOT_SERVING

RunningReplicas = Callable[[], Awaitable[dict[str, int]]]  # pool name -> running replicas


def needed_pools(mode: str) -> tuple[str, ...]:
    """The engine pools a generation needs in `mode`."""
    return ("colocated",) if mode == "colocated" else ("prefill", "decode")


def serve_pools(config, app_name: str) -> RunningReplicas:
    """Running replicas per pool of the Serve application `app_name` built from `config`, as
    Serve's controller counts them."""

    async def running() -> dict[str, int]:
        pools = await pool_statuses(config, app_name, [])
        return {p.pool: p.current_replicas for p in pools}

    return running


class Health:
    """Answers `Check` from `running()` (running replicas per pool), cached `CACHE_S`."""

    def __init__(self, mode: str, running: RunningReplicas, clock=time.monotonic) -> None:
        self.pools = needed_pools(mode)
        self.running = running
        self.clock = clock
        self._answer: tuple[float, int] | None = None  # (when, status)
        self._pending: asyncio.Future | None = None

    async def check(self, service: str) -> health_pb.HealthCheckResponse:
        if service not in SERVICES:
            raise NotFound(f"unknown service {service[:100]!r}", param="service")
        return health_pb.HealthCheckResponse(status=await self.status())

    async def status(self) -> int:
        if self._answer is not None and self.clock() - self._answer[0] < CACHE_S:
            return self._answer[1]
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._ask())
            self._pending.add_done_callback(self._settled)
        return await asyncio.shield(self._pending)

    async def _ask(self) -> int:
        try:
            running = await self.running()
        except Exception:
            status = NOT_SERVING  # the controller cannot tell: no pool is known to be up
        else:
            status = SERVING if all(running.get(p, 0) > 0 for p in self.pools) else NOT_SERVING
        self._answer = (self.clock(), status)
        return status

    def _settled(self, pending: asyncio.Future) -> None:
        self._pending = None
        if not pending.cancelled():
            pending.exception()  # retrieved (`_ask` catches what it can)
