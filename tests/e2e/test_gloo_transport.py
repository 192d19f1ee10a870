"""End to end on a real local Ray with `transfer.transport="gloo"`: router -> prefill pool ->
KV over a two-rank gloo group (negotiated over the gRPC control channel) -> decode pool; and
the same requests with the transport pinned to `grpc` (the shared "pd" app resolves `auto` to
nixl where it can). transformers' greedy decoding on the same checkpoint is the oracle."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from cluster.config import TransferConfig
from cluster.engine.engine import Engine
from cluster.kv_transfer.collective.collective_kv_client import CollectiveKVClient
from cluster.kv_transfer.transport_factory import make_kv_client
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.engine_kv import export_kv
from tests.ray_fixtures import app_metadata, deploy, small_app_config, stub, wait_for_idle

APP = "gloo"
GRPC_APP = "grpc"


def _deploy_with_transport(ray_serve, model_dir, transport: str, name: str):
    from ray import serve

    base = small_app_config(str(model_dir))
    transfer = TransferConfig(transport=transport, lease_seconds=10.0)
    deploy(replace(base, transfer=transfer), name, f"/{name}")
    yield ray_serve
    serve.delete(name)


@pytest.fixture(scope="module")
def gloo_app(ray_serve, tokenizer_model_dir):
    yield from _deploy_with_transport(ray_serve, tokenizer_model_dir, "gloo", APP)


@pytest.fixture(scope="module")
def grpc_app(ray_serve, tokenizer_model_dir):
    yield from _deploy_with_transport(ray_serve, tokenizer_model_dir, "grpc", GRPC_APP)


def test_concurrent_greedy_requests_over_gloo_match_transformers(gloo_app, tokenizer_model_dir, hf):
    _assert_concurrent_greedy(gloo_app, APP, tokenizer_model_dir, hf)


def test_concurrent_greedy_requests_over_grpc_match_transformers(grpc_app, tokenizer_model_dir, hf):
    _assert_concurrent_greedy(grpc_app, GRPC_APP, tokenizer_model_dir, hf)


def _assert_concurrent_greedy(endpoints, app: str, model_dir, hf) -> None:
    cases = [
        (tuple((11 * i + 7 * j) % 4000 + 50 for j in range(5 + (i * 9) % 50)), 6 + i % 5)
        for i in range(8)
    ]
    s = stub(endpoints)

    def run(case) -> list[pb.GenerateResponse]:
        ids, n = case
        sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        request = pb.GenerateRequest(prompt_token_ids=list(ids), sampling=sampling)
        return list(s.Generate(request, metadata=app_metadata(app)))

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for (ids, n), msgs in zip(cases, results, strict=True):
        got = [t for m in msgs for t in m.token_ids]
        hf.assert_greedy(model_dir, ids, got, n)
        last = msgs[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.timing.kv_transfer_seconds > 0
    stats = s.GetStats(pb.GetStatsRequest(), metadata=app_metadata(app))
    assert stats.kv_transport == app  # the transport the app was pinned to
    wait_for_idle(endpoints, app, {"prefill", "decode"})


def test_a_prefill_replica_serves_its_lease_over_gloo_across_processes(
    gloo_app, tokenizer_model_dir
):
    """This process joins a gloo group with the prefill replica (another Ray worker process)
    and gets the same KV a local engine computes for the prompt."""
    from ray import serve

    ids = tuple(range(100, 140))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prefill = serve.get_deployment_handle("Prefill", app_name=APP)
    result = prefill.prefill.remote(Request("direct-1", ids, params)).result()
    handle = result.handle
    assert handle.transport == "gloo"

    async def fetch():
        transfer = TransferConfig(
            transport="gloo", max_chunk_bytes=1 << 20, fetch_timeout_seconds=10.0
        )
        client = make_kv_client(transfer, torch.device("cpu"), 1 << 16)
        assert isinstance(client, CollectiveKVClient)
        try:
            kv = await client.fetch(handle, handle.layout)
            assert await client.release(handle, "fetched")
            assert len(client.channels) == 1
            return kv
        finally:
            await client.close()

    kv = asyncio.run(fetch())
    local = Engine(small_app_config(str(tokenizer_model_dir)).engine_config("prefill"))
    local.add_request(Request("local", ids, params, prefill_only=True))
    while local.has_work():
        local.step()
    want = export_kv(local, "local")
    assert local.release("local")
    assert kv.num_tokens == len(ids) and kv.k.shape == want.k.shape
    torch.testing.assert_close(kv.k, want.k)
    torch.testing.assert_close(kv.v, want.v)
    wait_for_idle(gloo_app, APP, {"prefill", "decode"})
