"""Going direct (`GenerationClient.direct`, `run_workload(direct=True)`): `GetStats` through the
given target lists the routers' own endpoints; calls go to them in turn, and to the target
itself when none is listed. Three fake `pdserve.v1.Generation` servers on loopback stand in
for a Serve proxy and two router replicas."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from cluster.client.generation_client import GenerationClient, router_endpoints
from cluster.client.load_generator import run_workload
from cluster.client.workload import synthetic_workload
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc


class Server(pb_grpc.GenerationServicer):
    """Answers every call, counting them; `GetStats` lists `routers` as router replicas."""

    def __init__(self, routers: list[str]) -> None:
        self.routers = routers
        self.calls: list[str] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_GenerationServicer_to_server(self, self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Generate(self, request, context):
        self.calls.append("Generate")
        n = request.sampling.max_tokens
        for i in range(n):
            last = i == n - 1
            yield pb.GenerateResponse(
                token_ids=[i], finish_reason=pb.FINISH_REASON_LENGTH if last else 0
            )

    def GetModelInfo(self, request, context):
        self.calls.append("GetModelInfo")
        return pb.ModelInfo(model_id="m", vocab_size=100)

    def GetStats(self, request, context):
        self.calls.append("GetStats")
        engine = pb.ReplicaStats(pool="decode", replica_id="d0", kv_blocks_total=8)
        routers = [
            pb.ReplicaStats(pool="router", replica_id=f"r{i}", grpc_endpoint=e)
            for i, e in enumerate(self.routers)
        ]
        return pb.ClusterStats(replicas=[engine, *routers])


@pytest.fixture
def cluster():
    routers = [Server([]), Server([])]
    proxy = Server([r.endpoint for r in routers])
    yield proxy, routers
    for s in (proxy, *routers):
        s.server.stop(None)


def request(n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=n))


def test_router_endpoints_are_the_router_replicas_listed_each_once():
    stats = pb.ClusterStats(
        replicas=[
            pb.ReplicaStats(pool="prefill", replica_id="p0"),
            pb.ReplicaStats(pool="router", replica_id="r1", grpc_endpoint="h:2"),
            pb.ReplicaStats(pool="router", replica_id="r0", grpc_endpoint="h:1"),
            pb.ReplicaStats(pool="router", replica_id="r2"),  # direct_grpc off
            pb.ReplicaStats(pool="router", replica_id="r3", grpc_endpoint="h:1"),
        ]
    )
    assert router_endpoints(stats) == ["h:1", "h:2"]
    assert router_endpoints(pb.ClusterStats()) == []


def test_direct_spreads_the_calls_over_the_routers_round_robin(cluster):
    proxy, routers = cluster
    with GenerationClient.direct(proxy.endpoint) as client:
        assert sorted(client.targets) == sorted(r.endpoint for r in routers)
        for _ in range(4):
            msgs = list(client.generate(request(3)))
            assert [t for m in msgs for t in m.token_ids] == [0, 1, 2]
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert proxy.calls == ["GetStats"]  # the proxy only told where the routers are
    assert [r.calls.count("Generate") for r in routers] == [2, 2]


def test_direct_falls_back_to_the_target_when_no_router_is_listed():
    proxy = Server([])
    try:
        with GenerationClient.direct(proxy.endpoint) as client:
            assert client.targets == [proxy.endpoint]
            assert client.model_info().model_id == "m"
        assert proxy.calls == ["GetStats", "GetModelInfo"]
    finally:
        proxy.server.stop(None)


def test_the_load_generator_goes_direct_round_robin(cluster):
    proxy, routers = cluster
    workload = synthetic_workload(6, 4, 3, 100, seed=1)
    records = asyncio.run(run_workload(proxy.endpoint, workload, direct=True))
    assert all(r.ok and len(r.token_ids) == 3 for r in records)
    assert proxy.calls == ["GetStats"]
    assert [r.calls.count("Generate") for r in routers] == [3, 3]
    through_proxy = asyncio.run(run_workload(proxy.endpoint, workload))
    assert all(r.ok for r in through_proxy) and proxy.calls.count("Generate") == 6


def test_pdserve_generate_direct_calls_a_router(cluster, capsys):
    from cluster.cli.main import main

    proxy, routers = cluster
    argv = ["generate", "--direct", "--target", proxy.endpoint, "--prompt-token-ids", "1,2"]
    assert main([*argv, "--max-tokens", "3", "--json"]) == 0
    assert '"token_ids": [0, 1, 2]' in capsys.readouterr().out
    assert proxy.calls == ["GetStats"]
    assert sum(r.calls.count("Generate") for r in routers) == 1
