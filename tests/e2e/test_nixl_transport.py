"""The default KV transport on the session's "pd" app (2 prefill x 2 decode replicas) is
`nixl` wherever NIXL works, as it does on this machine: the app reports it, and every other
test on "pd" (greedy output against transformers for 32 concurrent requests on every replica,
forged tokens, layout mismatches and expired leases with their documented codes, cancellations
at every phase) runs over it. Here: a prefill replica (a Ray worker process) serves its lease
to a NIXL READ from this process, bit-exact with a local engine's own prefill."""

from __future__ import annotations

import asyncio

import torch

from cluster.config import TransferConfig
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVCache
from cluster.kv_transfer.nixl.nixl_kv_client import NixlKVClient
from cluster.kv_transfer.transport_factory import make_kv_client
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.e2e.conftest import CO, PD
from tests.engine_kv import export_kv
from tests.ray_fixtures import app_metadata, small_app_config, stub, wait_for_idle


def test_the_apps_report_their_kv_transport(apps):
    s = stub(apps)
    pd = s.GetStats(pb.GetStatsRequest(), metadata=app_metadata(PD))
    co = s.GetStats(pb.GetStatsRequest(), metadata=app_metadata(CO))
    assert (pd.kv_transport, co.kv_transport) == ("nixl", "")


def test_a_prefill_replica_serves_its_lease_to_a_nixl_read_across_processes(
    apps, tokenizer_model_dir
):
    from ray import serve

    ids = tuple(range(100, 150))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prefill = serve.get_deployment_handle("Prefill", app_name=PD)
    handle = prefill.prefill.remote(Request("nixl-direct", ids, params)).result().handle
    assert handle.transport == "nixl"
    layout = handle.layout
    pool = KVCache(layout, 8, torch.float32, torch.device("cpu"))
    blocks = [5, 6, 2, 3]  # not contiguous, not where the prefill pool keeps them

    async def read() -> None:
        transfer = TransferConfig(
            transport="nixl", max_chunk_bytes=1 << 20, fetch_timeout_seconds=10.0
        )
        client = make_kv_client(transfer, pool.k.device, 8, pool)
        assert isinstance(client, NixlKVClient)
        try:
            assert await client.fetch_into(handle, pool, blocks) > 0
            assert await client.release(handle, "fetched")
            # One connection, dropped with the pair's last lease.
            assert client.connects == 1 and not client.peers and not client.unreachable
        finally:
            await client.close()

    asyncio.run(read())
    local = Engine(small_app_config(str(tokenizer_model_dir)).engine_config("prefill"))
    local.add_request(Request("local", ids, params, prefill_only=True))
    while local.has_work():
        local.step()
    want = export_kv(local, "local")
    assert local.release("local")
    # The prompt's tokens only: the rest of its last block is whatever the pools held before.
    for got, exact in ((pool.k[:, blocks], want.k), (pool.v[:, blocks], want.v)):
        tokens = len(ids)
        torch.testing.assert_close(got.flatten(1, 2)[:, :tokens], exact.flatten(1, 2)[:, :tokens])
    wait_for_idle(apps, PD, {"prefill", "decode"})
