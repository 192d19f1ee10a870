"""What the direct endpoint's tests share: the router's own methods over a generation service,
served by a started `GrpcServer` on loopback, and grpc.aio clients to it."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import grpc

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.serving.api_keys import ApiKeys
from router.direct import Admission, DirectLimits, GrpcServer, service_methods
from router.router import GENERATION, Router
from tests.router.fake_service import FakeService

# A client that announces a 1 KiB receive window and never grows it (a slow reader, as flow
# control sees it).
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


class Servicer:
    """The router's own methods (router/router.py) over a generation service; `GetStats`
    fails without setting a code."""

    Generate = Router.Generate
    GetModelInfo = Router.GetModelInfo

    def __init__(
        self, service, admission: Admission | None = None, keys: ApiKeys | None = None
    ) -> None:
        self.orch = service
        self.admission = admission or Admission(1024, 4096)
        self.keys = keys or ApiKeys(())

    async def GetStats(self, request, context):
        raise RuntimeError("no code set")


@asynccontextmanager
async def serving(service, limits: DirectLimits | None = None, admission: Admission | None = None):
    """`service` behind a started endpoint (`limits`, and the router's `admission` shared by
    the endpoint and the servicer's `Generate`); its "host:port"."""
    endpoint = GrpcServer("127.0.0.1", limits=limits, admission=admission)
    await endpoint.start(service_methods(GENERATION, Servicer(service, admission)))
    try:
        yield endpoint.endpoint
    finally:
        await endpoint.stop(1.0)


@asynccontextmanager
async def connected(service, options=None):
    """A grpc.aio client's stub and channel to `service` behind an endpoint."""
    async with serving(service) as endpoint:
        async with grpc.aio.insecure_channel(endpoint, options=options) as channel:
            yield pb_grpc.GenerationStub(channel), channel


def request(max_tokens: int, prompt: str = "hello") -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens))


async def until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def all_closed(fake: FakeService):
    return lambda: fake.opened == fake.closed


def greedy(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
