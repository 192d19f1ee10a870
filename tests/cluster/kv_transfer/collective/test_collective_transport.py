"""The collective KV transports end to end: a real KVServer (its `CollectiveKVSender`) on
loopback in front of a real prefill engine, a CollectiveKVClient, real two-rank
torch.distributed groups (gloo here; nccl behind the `gpu` marker), and a real decode engine
that imports the KV and decodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, ModelConfig, TransferConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVExport
from cluster.errors import FailedPrecondition, InvalidArgument, Unauthenticated, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.collective.collective_kv_client import CollectiveKVClient
from cluster.kv_transfer.collective.kv_channel import transport_device
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.transport_factory import make_kv_client
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferStub
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper
from tests.cluster.kv_transfer.kv_pair import (
    BLOCK_SIZE,
    MAX_CHUNK_BYTES,
    Pair,
    colocated,
    fetch_exact_then_decode,
    prompt,
    run,
)
from tests.engine_kv import export_kv


@dataclass
class CollectivePair(Pair):
    """`Pair` over a collective transport: its handles name the transport, its client is a
    `CollectiveKVClient`."""

    client: CollectiveKVClient
    transport: str = "gloo"

    @property
    def sender(self):
        """The server's sender of this transport."""
        return self.server.senders[self.transport]

    async def prefill_handle(self, rid: str, ids: tuple[int, ...]) -> KVHandle:
        return replace(await super().prefill_handle(rid, ids), transport=self.transport)


@asynccontextmanager
async def collective_pair(
    path: Path,
    transport: str = "gloo",
    *,
    devices: tuple[str, str] = ("cpu", "cpu"),
    lease_seconds: float = 30.0,
    expiry_interval: float | None = None,
    idle_seconds: float = 60.0,
    timeout_s: float = 30.0,
) -> AsyncIterator[CollectivePair]:
    def engine(device: str) -> AsyncEngine:
        cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=32)
        return AsyncEngine(Engine(EngineConfig(ModelConfig(str(path), device=device), cache)))

    prefill, decode = engine(devices[0]), engine(devices[1])
    prefill.start()
    decode.start()
    leases = LeaseKeeper(prefill, lease_seconds, Capability(b"test-secret"))
    if expiry_interval is not None:
        leases.start(expiry_interval)
    server = KVServer(
        prefill,
        leases,
        prefill.layout,
        "127.0.0.1",
        0,
        MAX_CHUNK_BYTES,
        transport=transport,
        channel_timeout_s=timeout_s,
        channel_idle_s=idle_seconds,
    )
    endpoint = await server.start()
    client = make_kv_client(
        TransferConfig(
            transport=transport,
            max_chunk_bytes=MAX_CHUNK_BYTES,
            fetch_timeout_seconds=timeout_s,
            channel_idle_seconds=idle_seconds,
        ),
        decode.device,
        32,
    )
    assert isinstance(client, CollectiveKVClient)
    p = CollectivePair(prefill, decode, leases, server, client, endpoint, transport)
    try:
        yield p
        await _settle(p)
        assert leases.outstanding() == 0
        assert await p.used_blocks() == (0, 0), "KV blocks leaked"
    finally:
        await p.close()


async def _settle(p: CollectivePair) -> None:
    """Sends end on the server a moment after the receiver has the data."""
    for _ in range(200):
        if p.leases.outstanding() == 0 and not p.sender._tasks:
            return
        await asyncio.sleep(0.01)


# -- the happy path ----------------------------------------------------------------------


def test_pushed_kv_decodes_like_a_colocated_run_over_one_cached_group(llama_dir: Path) -> None:
    prompts = {"r-long": prompt(40, 1), "r-exact": prompt(32, 2), "r-short": prompt(3, 3)}

    async def main() -> dict[str, list[int]]:
        async with collective_pair(llama_dir) as p:
            handles = {rid: await p.prefill_handle(rid, ids) for rid, ids in prompts.items()}
            # Bit-exact with the prefill pool's own export.
            want = await p.prefill.call(lambda e: export_kv(e, "r-long"))
            got = await p.client.fetch(handles["r-long"], p.decode.layout)
            assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
            assert got.num_tokens == 40 and tuple(got.k.shape[:2]) == (2, 3)
            (channel,) = p.client.channels._channels.values()
            assert len(p.sender.channels) == 1
            # Concurrent fetches over the same pair share (and queue on) the cached group.
            tokens = await asyncio.gather(
                *(p.fetch_and_decode(handles[rid], ids) for rid, ids in prompts.items())
            )
            assert p.client.channels.get(p.endpoint) is channel and not channel.closed
            assert len(p.sender.channels) == 1
            assert (p.leases.granted, p.leases.fetched, p.leases.expired) == (3, 3, 0)
            # A fetch after release finds no lease (NOT_FOUND on the wire) and keeps the group.
            with pytest.raises(Unavailable, match="expired or was released"):
                await p.client.fetch(handles["r-long"], p.decode.layout)
            assert p.client.channels.get(p.endpoint) is channel
            return dict(zip(prompts, tokens, strict=True))

    got = run(main())
    for rid, ids in prompts.items():
        assert got[rid] == colocated(llama_dir, rid, ids), rid


def test_idle_groups_are_evicted_on_both_sides_and_reopened(llama_dir: Path) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir, idle_seconds=0.3) as p:
            ids = prompt(20, 4)
            assert await p.fetch_and_decode(await p.prefill_handle("r1", ids), ids) == colocated(
                llama_dir, "r1", ids
            )
            old = p.client.channels.get(p.endpoint)
            assert old is not None and len(p.sender.channels) == 1
            await asyncio.sleep(1.0)
            assert len(p.client.channels) == 0 and len(p.sender.channels) == 0
            assert old.closed and p.client.channels.evicted == 1
            tokens = await p.fetch_and_decode(await p.prefill_handle("r2", ids), ids)
            assert tokens == colocated(llama_dir, "r2", ids)
            new = p.client.channels.get(p.endpoint)
            assert new is not None and new.id != old.id

    run(main())


def test_a_group_the_server_dropped_is_reopened_once(llama_dir: Path) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir) as p:
            ids = prompt(20, 5)
            await p.fetch_and_decode(await p.prefill_handle("r1", ids), ids)
            old = p.client.channels.get(p.endpoint)
            # The prefill side closes its end (as after an idle eviction or a failed send).
            assert p.sender.channels.drop(old.id)
            tokens = await p.fetch_and_decode(await p.prefill_handle("r2", ids), ids)
            assert tokens == colocated(llama_dir, "r2", ids)
            new = p.client.channels.get(p.endpoint)
            assert old.closed and new is not old and len(p.sender.channels) == 1

    run(main())


def test_a_broken_group_fails_the_transfer_as_unavailable(llama_dir: Path) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir, timeout_s=1.0) as p:
            ids = prompt(20, 6)
            await p.fetch_and_decode(await p.prefill_handle("r1", ids), ids)
            # The prefill side's group dies but its channel is still listed: the push is
            # accepted, the send fails there, the receive times out here.
            server_end = p.sender.channels.get(p.client.channels.get(p.endpoint).id)
            server_end._worker.submit(server_end._teardown).result()
            handle = await p.prefill_handle("r2", ids)
            with pytest.raises(Unavailable, match="broke"):
                await p.client.fetch(handle, p.decode.layout)
            assert len(p.client.channels) == 0
            # The sender drops its end when its failed send returns, which may be after the
            # receiver's own timeout here.
            deadline = time.monotonic() + 10.0
            while len(p.sender.channels) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(p.sender.channels) == 0
            # The lease survived; the next fetch opens a new group.
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r2", ids)

    run(main())


# -- refusals, each followed by a good fetch ----------------------------------------------


def test_wrong_token_is_unauthenticated_before_and_after_the_group_exists(
    llama_dir: Path,
) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir) as p:
            ids = prompt(20, 7)
            handle = await p.prefill_handle("r1", ids)
            forged = replace(handle, capability_token=bytes(32))
            with pytest.raises(Unauthenticated):  # refused by OpenChannel
                await p.client.fetch(forged, p.decode.layout)
            assert len(p.client.channels) == 0 and len(p.sender.channels) == 0
            other = replace(handle, capability_token=Capability(b"x").token("r1", handle.block_ids))
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)
            handle = await p.prefill_handle("r2", ids)
            with pytest.raises(Unauthenticated):  # refused by PushKV; the group stays
                await p.client.fetch(replace(other, request_id="r2"), p.decode.layout)
            assert len(p.client.channels) == 1
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r2", ids)

    run(main())


def test_open_channel_against_an_ended_lease_is_not_found(llama_dir: Path) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir) as p:
            ids = prompt(20, 9)
            handle = await p.prefill_handle("r1", ids)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)
            request = pb.OpenChannelRequest(transport="gloo", handle=handle.to_proto())
            async with grpc.aio.insecure_channel(p.endpoint) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # genuine token, lease over
                    await KVTransferStub(channel).OpenChannel(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            assert len(p.sender.channels) == 1  # the first fetch's only

    run(main())


def test_fetch_after_expiry_is_unavailable(llama_dir: Path) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir, lease_seconds=0.2, expiry_interval=0.05) as p:
            ids = prompt(40, 8)
            handle = await p.prefill_handle("r1", ids)
            await asyncio.sleep(0.5)
            assert await p.used_blocks() == (0, 0) and p.leases.expired == 1
            with pytest.raises(Unavailable, match="expired"):
                await p.client.fetch(handle, p.decode.layout)
            assert not await p.client.release(handle, "fetched")
            handle = await p.prefill_handle("r2", ids)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r2", ids)

    run(main())


def test_layout_mismatch_is_a_failed_precondition(llama_dir: Path) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir) as p:
            ids = prompt(40, 9)
            handle = await p.prefill_handle("r1", ids)
            # Caught on the decode side, before any network call.
            other = replace(p.decode.layout, block_size=32)
            offline = replace(handle, endpoint="127.0.0.1:1")
            with pytest.raises(FailedPrecondition, match="block_size"):
                await p.client.fetch(offline, other)
            # A handle claiming the receiver's (different) layout: the server refuses it.
            other = replace(p.decode.layout, model_id="another-model@123")
            with pytest.raises(FailedPrecondition, match="model_id"):
                await p.client.fetch(replace(handle, layout=other), other)
            # A handle of another collective transport.
            with pytest.raises(FailedPrecondition, match="nccl"):
                await p.client.fetch(replace(handle, transport="nccl"), p.decode.layout)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)

    run(main())


def test_grpc_handles_still_travel_over_grpc(llama_dir: Path) -> None:
    async def main() -> None:
        async with collective_pair(llama_dir) as p:
            ids = prompt(20, 10)
            handle = replace(await p.prefill_handle("r1", ids), transport="grpc")
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)
            assert len(p.client.channels) == 0 and len(p.sender.channels) == 0

    run(main())


def test_nccl_is_refused_where_it_cannot_run() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is here: nccl can run")
    with pytest.raises(InvalidArgument, match="nccl"):
        transport_device("nccl", torch.device("cpu"))


@pytest.mark.gpu
def test_gloo_moves_gpu_kv_through_host_memory(llama_dir: Path) -> None:
    """Engines on CUDA, transport gloo: the KV goes GPU -> host -> gloo -> host -> GPU and the
    decode continues like a colocated GPU run."""
    prompts = {"r-long": prompt(40, 13), "r-short": prompt(3, 14)}

    def from_the_gpu(got: KVExport, want: KVExport) -> None:
        assert want.k.is_cuda

    async def main() -> dict[str, list[int]]:
        async with collective_pair(llama_dir, "gloo", devices=("cuda", "cuda")) as p:
            return await fetch_exact_then_decode(p, prompts, from_the_gpu)

    got = run(main())
    for rid, ids in prompts.items():
        assert got[rid] == colocated(llama_dir, rid, ids, device="cuda"), rid


# -- nccl ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_nccl_moves_gpu_kv_between_two_devices(llama_dir: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL refuses two ranks on one GPU: needs two devices")
    prompts = {"r-long": prompt(40, 11), "r-short": prompt(3, 12)}

    def straight_into_gpu_memory(got: KVExport, want: KVExport) -> None:
        assert got.k.device == torch.device("cuda:1")

    async def main() -> dict[str, list[int]]:
        async with collective_pair(llama_dir, "nccl", devices=("cuda:0", "cuda:1")) as p:
            return await fetch_exact_then_decode(p, prompts, straight_into_gpu_memory)

    got = run(main())
    for rid, ids in prompts.items():
        assert got[rid] == colocated(llama_dir, rid, ids), rid
