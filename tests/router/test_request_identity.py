"""The client's request_id is a label: every call the router makes for a request runs under
an id of the server's own (pools replaced by the doubles of test_orchestrator)."""

from __future__ import annotations

import asyncio

from cluster.config import ModelConfig, TransferConfig
from cluster.model.info import ArchSpec, ModelInfo
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig
from router.lease_releases import LeaseReleases
from router.orchestrator import Orchestrator
from router.token_stream import TokenStreamServer
from tests.router.test_orchestrator import (
    CAPABILITY,
    SECRET,
    FakePools,
    Releases,
    prefill_endpoints,
    run,
    tokens,
)


def test_every_attempt_has_an_id_of_its_own_and_the_client_sees_its_label():
    pools = FakePools(prefill_failures=1, decode_plan=["fail-late", "ok"])
    chunks = run(pools, max_tokens=4)
    assert tokens(chunks) == [7, 8, 9, 10]
    assert {c.request_id for c in chunks} == {"r1"}
    # prefill (failed), prefill, decode (failed mid-stream), re-prefill, decode
    assert len(pools.ids) == 5 and "r1" not in pools.ids
    attempts = [pools.ids[0], pools.ids[1], pools.ids[3]]
    assert len(set(attempts)) == 3, "a retry or a migration reused an attempt's id"
    assert pools.ids[2] == pools.ids[1] and pools.ids[4] == pools.ids[3]  # decode: its prefill's


def test_two_clients_using_one_request_id_at_once_get_their_own_complete_streams():
    async def both():
        pools = FakePools(prefill_seconds=0.05)
        spec = ArchSpec(
            512, 64, 128, 2, 4, 2, 8, 1e-5, 256, {}, False, False, False, False, False, None
        )
        info = ModelInfo(spec, None, "m@0", frozenset(), 256)
        config = AppConfig(
            model=ModelConfig(path="/nonexistent"), transfer=TransferConfig(secret=SECRET)
        )
        server = TokenStreamServer("127.0.0.1")
        await server.start()
        try:
            orch = Orchestrator(config, info, pools.prefill, pools.decode, pools.colocated, server)
            orch.leases = LeaseReleases(Releases(), CAPABILITY, prefill_endpoints)

            async def one(max_tokens):
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
                request = await orch.build_request(None, [1, 2, 3], params, "same")
                return [c async for c in orch.generate(request)]

            got = await asyncio.gather(one(3), one(5))
            await asyncio.gather(*pools.worker_calls, return_exceptions=True)
            await orch.close()
            return got, pools.ids
        finally:
            await server.stop()

    (a, b), ids = asyncio.run(both())
    assert tokens(a) == [7, 8, 9] and tokens(b) == [7, 8, 9, 10, 11]
    assert a[-1].finish_reason == b[-1].finish_reason == "length"
    assert {c.request_id for c in a + b} == {"same"}
    assert len(set(ids)) == 2 and "same" not in ids
