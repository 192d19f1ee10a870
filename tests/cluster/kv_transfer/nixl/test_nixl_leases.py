"""NIXL access is bounded by leases: the prefill agent's metadata goes only to a reader that shows
a live lease (an ended or expired one is NOT_FOUND, as for FetchKV), the prefill side tracks which
reader agent was given access for which leases, and a pair is dropped on both ends when its last
lease ends; a reader the server dropped is refused its next hold (ABORTED) and connects again.
Transfers stay bit-exact throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from cluster.errors import Unavailable
from cluster.kv_transfer.kv_handle import layout_to_proto
from cluster.kv_transfer.nixl.nixl_pool import load_nixl
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferStub
from tests.cluster.kv_transfer.kv_pair import colocated, prompt, run
from tests.cluster.kv_transfer.nixl.nixl_pair import NixlPair, nixl_pair, sender
from tests.engine_kv import export_kv

try:
    load_nixl()
except Exception:  # pragma: no cover - nixl is a dependency on Linux x86_64
    pytest.skip("NIXL is not installed here", allow_module_level=True)


async def raw_call(p: NixlPair, method: str, request) -> grpc.StatusCode:
    """Call `method` of the KV server on a channel of its own; the status it ends with."""
    async with grpc.aio.insecure_channel(p.endpoint) as channel:
        call = getattr(KVTransferStub(channel), method)(request, timeout=10)
        try:
            if method == "HoldKV":
                await call.read()
            else:
                await call
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


def test_connect_against_an_ended_or_expired_lease_is_not_found(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir, lease_seconds=1.0, expiry_interval=0.05) as p:
            ids = prompt(20, 11)
            done = await p.prefill_handle("r1", ids)
            assert await p.fetch_and_decode(done, ids) == colocated(llama_dir, "r1", ids)
            expired = await p.prefill_handle("r2", ids)
            await asyncio.sleep(1.2)
            assert p.leases.expired == 1
            layout = layout_to_proto(p.decode.layout)
            for handle in (done, expired):  # genuine tokens, ended leases
                request = pb.ConnectNixlRequest(
                    handle=handle.to_proto(), receiver_layout=layout, reader_agent="reader-x"
                )
                assert await raw_call(p, "ConnectNixl", request) == grpc.StatusCode.NOT_FOUND
                with pytest.raises(Unavailable, match="expired or was released"):
                    await p.client.fetch(handle, p.decode.layout)
            assert not sender(p).access.readers and not p.client.peers
            assert p.client.connects == 1  # the first transfer's only
            # A live lease whose request names no reader is refused before anything is handed out.
            live = await p.prefill_handle("r3", ids)
            request = pb.ConnectNixlRequest(handle=live.to_proto(), receiver_layout=layout)
            assert await raw_call(p, "ConnectNixl", request) == grpc.StatusCode.INVALID_ARGUMENT
            assert await p.fetch_and_decode(live, ids) == colocated(llama_dir, "r3", ids)

    run(main())


def test_the_pair_is_dropped_on_both_ends_when_its_last_lease_ends(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir) as p:
            ids1, ids2, ids3 = prompt(40, 12), prompt(24, 13), prompt(33, 14)
            h1, h2 = await p.prefill_handle("r1", ids1), await p.prefill_handle("r2", ids2)
            want = await p.prefill.call(lambda e: export_kv(e, "r1"))
            got = await p.client.fetch(h1, p.decode.layout)
            assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)  # bit-exact
            await p.client.fetch(h2, p.decode.layout)  # same connection
            reader = p.client.agent.name
            assert p.client.connects == 1 and sender(p).access.readers == {reader: {"r1", "r2"}}
            assert await p.client.release(h1, "fetched")
            assert len(p.client.peers) == 1 and sender(p).access.readers == {reader: {"r2"}}
            assert await p.client.release(h2, "aborted")  # the last lease: dropped both ends
            assert not p.client.peers and not p.client.leases
            assert not sender(p).access.readers and sender(p).access.dropped == 1
            # A hold without access is refused; the next transfer connects again, bit-exact.
            h3 = await p.prefill_handle("r3", ids3)
            request = pb.HoldKVRequest(
                handle=h3.to_proto(),
                receiver_layout=layout_to_proto(p.decode.layout),
                reader_agent=reader,
            )
            assert await raw_call(p, "HoldKV", request) == grpc.StatusCode.ABORTED
            assert await p.fetch_and_decode(h3, ids3) == colocated(llama_dir, "r3", ids3)
            assert p.client.connects == 2 and not p.client.peers

    run(main())


def test_a_reader_whose_lease_expired_is_refused_then_connects_again(llama_dir: Path) -> None:
    async def main() -> None:
        async with nixl_pair(llama_dir, lease_seconds=1.0, expiry_interval=0.05) as p:
            ids = prompt(40, 15)
            h1 = await p.prefill_handle("r1", ids)
            await p.client.fetch(h1, p.decode.layout)  # connected; never released
            await asyncio.sleep(1.2)  # r1 expires: the server drops the reader
            assert p.leases.expired == 1 and not sender(p).access.readers
            assert len(p.client.peers) == 1  # the client has not heard yet
            h2 = await p.prefill_handle("r2", ids)
            # HoldKV is refused (ABORTED); the client drops its peer, connects with r2, reads.
            assert await p.fetch_and_decode(h2, ids) == colocated(llama_dir, "r2", ids)
            assert p.client.connects == 2
            assert not await p.client.release(h1, "fetched")  # expired already
            assert not p.client.peers and not sender(p).access.readers

    run(main())
