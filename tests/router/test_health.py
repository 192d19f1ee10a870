"""`grpc.health.v1.Health/Check` (router/health.py): SERVING only while every pool the mode needs
has a running replica, one controller call per second however many probes come, NOT_FOUND for a
service the router does not serve; and grpc's own health client gets those answers from a grpc
server (`add_health_check`, as on Serve's proxy) and from the router's direct endpoint, where
`Watch` is UNIMPLEMENTED. Through the real cluster: tests/e2e/test_openai_parity.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cluster.errors import NotFound
from cluster.pb.grpc.health.v1 import health_pb2 as health_pb
from cluster.pb.grpc.health.v1 import health_pb2_grpc as health_grpc
from router.direct import GrpcServer, service_methods
from router.grpc_ingress import add_generation_servicer, add_health_check
from router.health import CACHE_S, NOT_SERVING, SERVING, Health
from router.router import HEALTH, Router


class _Pools:
    """Running replicas per pool, as Serve's controller would tell; counts the questions."""

    def __init__(self, **running: int) -> None:
        self.running = running
        self.asked = 0
        self.fail = False

    async def __call__(self) -> dict[str, int]:
        self.asked += 1
        await asyncio.sleep(0.01)
        if self.fail:
            raise RuntimeError("controller unreachable")
        return dict(self.running)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("mode", "running", "status"),
    [
        ("disaggregated", {"router": 1, "prefill": 1, "decode": 2}, SERVING),
        ("disaggregated", {"router": 1, "prefill": 0, "decode": 2}, NOT_SERVING),
        ("disaggregated", {"router": 1, "prefill": 1}, NOT_SERVING),
        ("colocated", {"router": 1, "colocated": 1}, SERVING),
        ("colocated", {"router": 1, "colocated": 0}, NOT_SERVING),
    ],
)
def test_serving_needs_a_replica_in_every_pool_of_the_mode(mode, running, status) -> None:
    health = Health(mode, _Pools(**running))
    assert asyncio.run(health.check("")).status == status


def test_probes_share_one_controller_call_per_period() -> None:
    pools, clock = _Pools(prefill=1, decode=1), _Clock()
    health = Health("disaggregated", pools, clock)

    async def probes(k: int) -> list[int]:
        answers = await asyncio.gather(*(health.check("") for _ in range(k)))
        return [a.status for a in answers]

    assert asyncio.run(probes(50)) == [SERVING] * 50 and pools.asked == 1
    pools.running["decode"] = 0
    assert asyncio.run(probes(5)) == [SERVING] * 5 and pools.asked == 1  # cached
    clock.now += CACHE_S
    assert asyncio.run(probes(5)) == [NOT_SERVING] * 5 and pools.asked == 2


def test_a_controller_that_cannot_answer_is_not_serving() -> None:
    pools = _Pools(prefill=1, decode=1)
    pools.fail = True
    assert asyncio.run(Health("disaggregated", pools).check("")).status == NOT_SERVING


def test_services_by_name() -> None:
    health = Health("disaggregated", _Pools(prefill=1, decode=1))
    assert asyncio.run(health.check("pdserve.v1.Generation")).status == SERVING
    with pytest.raises(NotFound, match="unknown service"):
        asyncio.run(health.check("pdserve.v1.Nope"))


class _Servicer:
    """The router's `Check` (router/router.py: `Router.Check` itself) over a `Health`."""

    Check = Router.Check

    def __init__(self, health: Health) -> None:
        self.health = health


async def _ask(target: str) -> tuple[list, grpc.StatusCode, grpc.StatusCode]:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_grpc.HealthStub(channel)
        statuses = [
            (await stub.Check(health_pb.HealthCheckRequest(service=s))).status
            for s in ("", "pdserve.v1.Generation")
        ]
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Check(health_pb.HealthCheckRequest(service="x.Y"))
        with pytest.raises(grpc.aio.AioRpcError) as watch:
            await stub.Watch(health_pb.HealthCheckRequest()).read()
    return statuses, unknown.value.code(), watch.value.code()


def test_grpc_health_client_on_a_grpc_server() -> None:
    async def go():
        server = grpc.aio.server()
        add_health_check(_Servicer(Health("disaggregated", _Pools(prefill=1, decode=1))), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await _ask(f"127.0.0.1:{port}")
        finally:
            await server.stop(None)

    assert asyncio.run(go()) == (
        [SERVING, SERVING],
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    )


def test_grpc_health_client_on_the_direct_endpoint() -> None:
    async def go():
        server = GrpcServer("127.0.0.1")
        servicer = _Servicer(Health("colocated", _Pools(colocated=0)))
        endpoint = await server.start(service_methods(HEALTH, servicer))
        try:
            return await _ask(endpoint)
        finally:
            await server.stop(1.0)

    assert asyncio.run(go()) == (
        [NOT_SERVING, NOT_SERVING],
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    )


def test_on_serves_proxy_server_check_is_routed_with_status_mapping() -> None:
    from unittest.mock import Mock

    from ray.serve._private.grpc_util import gRPCGenericServer

    def factory(service_method: str, streaming_type):
        async def unary(request, context):
            return b""

        return unary

    async def go():
        server = gRPCGenericServer(factory)
        add_generation_servicer(Mock(), server)  # as Serve's proxy registers servicers
        handlers = {}
        for (generic,) in server.generic_rpc_handlers:
            handlers.update(generic._method_handlers)
        assert "/grpc.health.v1.Health/Watch" not in handlers
        check = handlers["/grpc.health.v1.Health/Check"].unary_unary
        assert "_with_status_mapping" in check.__qualname__

    asyncio.run(go())
