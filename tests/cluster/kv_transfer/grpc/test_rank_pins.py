"""The pins a tensor-parallel rank's KV server holds on rank 0 (`PinKV`, `LeaderPins`), against
a real prefill engine, `LeaseKeeper` and `KVServer` on loopback (`tests/tp_pairs.py`, TP 1):
a KV server holds at most `max_pins` pins at once (RESOURCE_EXHAUSTED beyond, naming the
limit; served again once one ends), and `LeaderPins` looks rank 0's endpoint up once."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import grpc
import pytest

from cluster.errors import ResourceExhausted
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc.rank_server import LeaderPins
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from prefill_worker.kv_server import MAX_PINS
from tests.conftest import build_checkpoint, prompt
from tests.tp_pairs import SECRET, tp_pairs


def test_pins_are_bounded_and_rank_zero_is_looked_up_once(tmp_path):
    checkpoint = build_checkpoint("llama-gqa", tmp_path)
    assert MAX_PINS >= 256  # the documented default: far above a TP replica's reads in flight

    async def body():
        with ExitStack() as stack:
            async with tp_pairs(checkpoint, stack, pairs=[(1, 1)], max_pins=2) as p:
                handle = await p.handle(1, "pins", prompt(9, seed=9))
                server = p.servers[1]
                lookups = []

                def leader() -> str:
                    lookups.append(1)
                    return handle.endpoint

                stubs = p.client[1].slices.stubs
                pins = LeaderPins(Capability(bytes.fromhex(SECRET)), stubs, leader, 10.0)
                token = handle.capability_token
                for _ in range(2):
                    assert (await pins.begin_fetch("pins", token))[0] == list(handle.block_ids)
                assert server.pins == 2 and len(lookups) == 1
                with pytest.raises(ResourceExhausted, match="max_pins"):
                    await pins.begin_fetch("pins", token)
                request = pb.PinKVRequest(request_id="pins", capability_token=token)
                call = stubs.stub(handle.endpoint).PinKV(request, timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                pins.end_fetch("pins")
                deadline = time.monotonic() + 5
                while server.pins > 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                await pins.begin_fetch("pins", token)  # served again
                pins.end_fetch("pins")
                pins.end_fetch("pins")
                while server.pins and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
                assert server.pins == 0 and len(lookups) == 1
                assert await p.client[1].release(handle, "fetched")

    asyncio.run(asyncio.wait_for(body(), 120))
