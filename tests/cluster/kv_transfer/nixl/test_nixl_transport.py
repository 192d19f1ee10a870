"""The `nixl` KV transport end to end in one process: a real KVServer (its `NixlKVSender`, the
prefill pool registered with a NIXL agent) on loopback in front of a real prefill engine, a
`NixlKVClient` with the decode engine's pool registered with another agent, UCX moving the
bytes, and a real decode engine that decodes from the blocks the READ filled."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cluster.engine.async_engine import AsyncEngine
from cluster.errors import FailedPrecondition, Unauthenticated, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.nixl.nixl_pool import load_nixl
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper
from tests.cluster.kv_transfer.kv_pair import MAX_CHUNK_BYTES, colocated, make_engine, prompt, run
from tests.cluster.kv_transfer.nixl.nixl_pair import nixl_pair, sender
from tests.engine_kv import export_kv

try:
    load_nixl()
except Exception:  # pragma: no cover - nixl is a dependency on Linux x86_64
    pytest.skip("NIXL is not installed here", allow_module_level=True)


def test_read_kv_is_bit_exact_and_decodes_like_a_colocated_run(llama_dir: Path) -> None:
    prompts = {"r-long": prompt(40, 1), "r-exact": prompt(32, 2), "r-short": prompt(3, 3)}

    async def main() -> dict[str, list[int]]:
        async with nixl_pair(llama_dir) as p:
            handles = {rid: await p.prefill_handle(rid, ids) for rid, ids in prompts.items()}
            want = await p.prefill.call(lambda e: export_kv(e, "r-long"))
            got = await p.client.fetch(handles["r-long"], p.decode.layout)  # into new tensors
            assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
            tokens = await asyncio.gather(
                *(p.fetch_and_decode(handles[rid], ids) for rid, ids in prompts.items())
            )
            assert (p.leases.granted, p.leases.fetched, p.leases.expired) == (3, 3, 0)
            # The pair's last lease ended: both ends dropped it.
            assert not p.client.peers and not sender(p).access.readers
            # A read after release finds no lease (NOT_FOUND on the wire).
            with pytest.raises(Unavailable, match="expired or was released"):
                await p.client.fetch(handles["r-long"], p.decode.layout)
            return dict(zip(prompts, tokens, strict=True))

    got = run(main())
    for rid, ids in prompts.items():
        assert got[rid] == colocated(llama_dir, rid, ids), rid


def test_contiguous_blocks_are_merged_into_one_descriptor_per_layer(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir) as p:
            ids = prompt(64, 4)  # 4 blocks, contiguous in both fresh pools
            handle = await p.prefill_handle("r1", ids)
            layers = p.decode.layout.num_layers
            before = p.client.descriptors_posted
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)
            assert p.client.descriptors_posted - before == 2 * layers  # not 2 * layers * 4

    run(main())


def test_wrong_token_is_unauthenticated_before_and_after_the_pair_connected(
    llama_dir: Path,
) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir) as p:
            ids = prompt(20, 5)
            handle = await p.prefill_handle("r1", ids)
            with pytest.raises(Unauthenticated):  # refused by ConnectNixl
                await p.fetch_and_decode(replace(handle, capability_token=bytes(32)), ids)
            assert not p.client.peers and not sender(p).access.readers
            live = await p.client.fetch(handle, p.decode.layout)  # connects; r1 stays leased
            assert live.num_tokens == len(ids) and len(p.client.peers) == 1
            handle2 = await p.prefill_handle("r2", ids)
            forged = Capability(b"x").token("r2", handle2.block_ids)
            with pytest.raises(Unauthenticated):  # refused by HoldKV; the peer stays
                await p.fetch_and_decode(replace(handle2, capability_token=forged), ids)
            assert len(p.client.peers) == 1 and p.client.connects == 1
            assert await p.fetch_and_decode(handle2, ids) == colocated(llama_dir, "r2", ids)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)

    run(main())


def test_read_after_expiry_is_unavailable_and_frees_the_reserved_blocks(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir, lease_seconds=0.2, expiry_interval=0.05) as p:
            ids = prompt(40, 6)
            handle = await p.prefill_handle("r1", ids)
            await asyncio.sleep(0.5)
            assert await p.used_blocks() == (0, 0) and p.leases.expired == 1
            with pytest.raises(Unavailable, match="expired"):
                await p.fetch_and_decode(handle, ids)
            assert await p.used_blocks() == (0, 0)
            assert not await p.client.release(handle, "fetched")

    run(main())


def test_layout_mismatch_is_a_failed_precondition(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir) as p:
            ids = prompt(40, 7)
            handle = await p.prefill_handle("r1", ids)
            other = replace(p.decode.layout, block_size=32)
            with pytest.raises(FailedPrecondition, match="block_size"):  # before any call
                await p.client.fetch(replace(handle, endpoint="127.0.0.1:1"), other)
            other = replace(p.decode.layout, model_id="another-model@123")
            with pytest.raises(FailedPrecondition, match="model_id"):  # refused by the server
                await p.client.fetch(replace(handle, layout=other), other)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)

    run(main())


def test_a_cancelled_read_ends_only_after_the_read_and_frees_both_sides(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir) as p:
            ids = prompt(40, 8)
            handle = await p.prefill_handle("r1", ids)
            agent = p.client.agent
            real_read, ended = agent.read, []

            def slow_read(*args):
                time.sleep(0.4)
                result = real_read(*args)
                ended.append(time.monotonic())
                return result

            agent.read = slow_read
            engine, freed = p.decode.engine, []
            cancel_import = engine.cancel_import

            def recorded_cancel_import(rid: str) -> bool:
                freed.append(time.monotonic())
                return cancel_import(rid)

            engine.cancel_import = recorded_cancel_import
            task = asyncio.ensure_future(p.fetch_and_decode(handle, ids))
            await asyncio.sleep(0.2)
            assert sender(p).holds == 1  # the lease is pinned for the reader
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert ended and freed and ended[0] <= freed[0]  # the READ ended before the free
            agent.read = real_read
            assert await p.used_blocks() == (40 // 16 + 1, 0)  # the lease still holds
            for _ in range(100):  # the server sees the hold's call cancelled
                if sender(p).holds == 0:
                    break
                await asyncio.sleep(0.01)
            assert await p.client.release(handle, "aborted")

    run(main())


def test_a_peer_nixl_cannot_load_is_fetched_over_grpc(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir) as p:
            ids = prompt(20, 9)

            def refuse(desc):
                raise Unavailable("no route")

            p.client.agent.add_peer = refuse
            handle = await p.prefill_handle("r1", ids)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)
            assert p.client.unreachable == {p.endpoint}

    run(main())


def test_a_server_where_nixl_cannot_start_serves_grpc(llama_dir: Path, monkeypatch) -> None:
    from cluster.kv_transfer import nixl

    def broken(*args, **kwargs):
        raise Unavailable("no UCX here")

    monkeypatch.setattr(nixl, "NixlKVSender", broken)

    async def main() -> None:
        prefill = AsyncEngine(make_engine(llama_dir))
        leases = LeaseKeeper(prefill, 30.0, Capability(b"test-secret"))
        server = KVServer(
            prefill, leases, prefill.layout, "127.0.0.1", 0, MAX_CHUNK_BYTES, transport="nixl"
        )
        assert server.transport == "grpc" and list(server.senders) == ["grpc"]

    run(main())
