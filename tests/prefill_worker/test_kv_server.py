"""The `grpc` KV transport end to end: a real grpc.aio KVServer on loopback in front of a real
prefill engine, a GrpcKVClient, and a real decode engine that imports the KV and decodes; the
refusals on the wire; the handle's own validation."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import grpc
import msgpack
import pytest
import torch

from cluster.engine.kv_cache import KVExport
from cluster.errors import FailedPrecondition, InvalidArgument, Unauthenticated, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto
from cluster.kv_transfer.kv_wire import DTYPES
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferStub
from tests.cluster.kv_transfer.kv_pair import (
    BLOCK_SIZE,
    MAX_CHUNK_BYTES,
    colocated,
    fetch_exact_then_decode,
    pair,
    prompt,
    run,
)
from tests.engine_kv import export_kv

# -- the happy path ----------------------------------------------------------------------


def test_fetched_kv_decodes_like_a_colocated_run(llama_dir: Path) -> None:
    prompts = {"r-long": prompt(40, 1), "r-exact": prompt(32, 2), "r-short": prompt(3, 3)}

    async def main() -> dict[str, list[int]]:
        async with pair(llama_dir) as p:
            assert p.endpoint.startswith("127.0.0.1:") and not p.endpoint.endswith(":0")
            handles = {rid: await p.prefill_handle(rid, ids) for rid, ids in prompts.items()}
            # The wire copy is bit-exact with the prefill pool's own export.
            h = handles["r-long"]
            want = await p.prefill.call(lambda e: export_kv(e, "r-long"))
            got = await p.client.fetch(h, p.decode.layout)
            assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
            assert got.num_tokens == 40 and tuple(got.k.shape[:2]) == (2, 3)
            # Concurrent fetches share one channel.
            tokens = await asyncio.gather(
                *(p.fetch_and_decode(handles[rid], ids) for rid, ids in prompts.items())
            )
            assert (p.leases.granted, p.leases.fetched, p.leases.expired) == (3, 3, 0)
            # A second release, or a fetch after release, finds no lease.
            assert not await p.client.release(h, "fetched")
            with pytest.raises(Unavailable, match="expired or was released"):
                await p.client.fetch(h, p.decode.layout)
            return dict(zip(prompts, tokens, strict=True))

    got = run(main())
    for rid, ids in prompts.items():
        assert got[rid] == colocated(llama_dir, rid, ids), rid


# -- failures, each followed by a good fetch ----------------------------------------------


def test_wrong_token_is_unauthenticated(llama_dir: Path) -> None:
    async def main() -> None:
        async with pair(llama_dir) as p:
            ids = prompt(20, 4)
            handle = await p.prefill_handle("r1", ids)
            forged = replace(handle, capability_token=bytes(32))
            with pytest.raises(Unauthenticated):
                await p.client.fetch(forged, p.decode.layout)
            other = Capability(b"other-secret").token("r1", handle.block_ids)
            with pytest.raises(Unauthenticated):
                await p.client.fetch(replace(handle, capability_token=other), p.decode.layout)
            # A forged release is refused (best effort: False), and the lease survives it.
            assert not await p.client.release(forged, "aborted")
            assert p.leases.outstanding() == 1
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)

    run(main())


def test_fetch_after_expiry_is_unavailable_and_blocks_are_already_free(llama_dir: Path) -> None:
    async def main() -> None:
        async with pair(llama_dir, lease_seconds=0.2, expiry_interval=0.05) as p:
            ids = prompt(40, 5)
            handle = await p.prefill_handle("r1", ids)
            assert (await p.used_blocks())[0] == 3
            await asyncio.sleep(0.5)
            assert await p.used_blocks() == (0, 0)
            assert p.leases.expired == 1 and p.leases.outstanding() == 0
            with pytest.raises(Unavailable, match="expired"):
                await p.client.fetch(handle, p.decode.layout)
            assert not await p.client.release(handle, "fetched")
            handle = await p.prefill_handle("r2", ids)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r2", ids)

    run(main())


def test_late_fetch_is_refused_even_before_the_expiry_task_runs(llama_dir: Path) -> None:
    now = [1000.0]

    async def main() -> None:
        async with pair(llama_dir, lease_seconds=5.0, clock=lambda: now[0]) as p:
            ids = prompt(20, 6)
            handle = await p.prefill_handle("r1", ids)
            assert handle.lease_expiry_unix == 1005.0
            now[0] = 1005.0
            with pytest.raises(Unavailable, match="expired"):
                await p.client.fetch(handle, p.decode.layout)
            assert p.leases.expired == 1 and (await p.used_blocks())[0] == 0

    run(main())


def test_layout_mismatch_is_a_failed_precondition(llama_dir: Path) -> None:
    async def main() -> None:
        async with pair(llama_dir) as p:
            ids = prompt(40, 7)
            handle = await p.prefill_handle("r1", ids)
            # Caught on the decode side, before any network call: the endpoint is unreachable.
            other = replace(p.decode.layout, block_size=32)
            offline = replace(handle, endpoint="127.0.0.1:1")
            with pytest.raises(FailedPrecondition, match="block_size"):
                await p.client.fetch(offline, other)
            # A handle claiming the receiver's (different) layout: the server refuses it.
            other = replace(p.decode.layout, model_id="another-model@123")
            with pytest.raises(FailedPrecondition, match="model_id"):
                await p.client.fetch(replace(handle, layout=other), other)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)

    run(main())


def test_status_codes_chunk_bounds_and_cancelled_streams_on_the_wire(llama_dir: Path) -> None:
    async def main() -> None:
        async with pair(llama_dir) as p:
            handle = await p.prefill_handle("r1", prompt(40, 10))
            layout = layout_to_proto(p.decode.layout)
            async with grpc.aio.insecure_channel(p.endpoint) as channel:
                stub = KVTransferStub(channel)

                async def fetch(h: KVHandle, max_chunk_bytes: int = 0, **kw) -> list[pb.KVChunk]:
                    req = pb.FetchKVRequest(
                        handle=h.to_proto(), max_chunk_bytes=max_chunk_bytes, **kw
                    )
                    return [c async for c in stub.FetchKV(req)]

                async def code_of(coro) -> grpc.StatusCode:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await coro
                    return err.value.code()

                forged = replace(handle, capability_token=bytes(32))
                unauth = grpc.StatusCode.UNAUTHENTICATED
                assert await code_of(fetch(forged, receiver_layout=layout)) == unauth
                assert await code_of(fetch(handle)) == grpc.StatusCode.INVALID_ARGUMENT
                bad_release = pb.ReleaseKVRequest(request_id="r1", reason="aborted")
                assert await code_of(stub.ReleaseKV(bad_release)) == unauth
                bad_reason = pb.ReleaseKVRequest(
                    request_id="r1", capability_token=handle.capability_token, reason="bored"
                )
                assert await code_of(stub.ReleaseKV(bad_reason)) == grpc.StatusCode.INVALID_ARGUMENT

                # A bound below one block of one layer is raised to it; above the server's
                # own bound, lowered to it.
                unit = 2 * BLOCK_SIZE * 2 * 16 * 4
                for asked, size in [(1, unit), (0, MAX_CHUNK_BYTES), (1 << 30, MAX_CHUNK_BYTES)]:
                    chunks = await fetch(handle, asked, receiver_layout=layout)
                    assert max(len(c.data) for c in chunks) == size
                    assert sum(len(c.data) for c in chunks) == 2 * 3 * unit
                    assert msgpack.unpackb(chunks[0].header)["nbytes"] == len(chunks[0].data)

                # A client that walks away mid-stream unpins the lease.
                req = pb.FetchKVRequest(
                    handle=handle.to_proto(), receiver_layout=layout, max_chunk_bytes=1
                )
                call = stub.FetchKV(req)
                await call.read()
                call.cancel()
                for _ in range(100):
                    if p.leases._leases["r1"].fetches == 0:
                        break
                    await asyncio.sleep(0.01)
                assert p.leases._leases["r1"].fetches == 0
            assert await p.client.release(handle, "aborted")

    run(main())


def test_handle_proto_round_trip_and_validation(llama_dir: Path) -> None:
    async def main() -> KVHandle:
        async with pair(llama_dir) as p:
            handle = await p.prefill_handle("r1", prompt(33, 9))
            await p.client.release(handle, "aborted")
            assert p.leases.aborted == 1
            return handle

    handle = run(main())
    assert KVHandle.from_proto(handle.to_proto()) == handle
    no_first = replace(handle, first_token_id=None)
    assert KVHandle.from_proto(no_first.to_proto()).first_token_id is None
    bad_edits = [
        dict(request_id=""),
        dict(num_tokens=0),
        dict(num_tokens=49),  # 4 blocks' worth, the handle lists 3
        dict(endpoint="no-port"),
        dict(endpoint="host:0"),
        dict(transport="carrier-pigeon"),
        dict(block_size=32),
        dict(block_ids=handle.block_ids[:-1]),
        dict(block_ids=(1, 1, 2)),
        dict(capability_token=b""),
        dict(lease_expiry_unix=float("nan")),
    ]
    for edit in bad_edits:
        msg = handle.to_proto()
        for key, value in edit.items():
            if key == "block_ids":
                del msg.block_ids[:]
                msg.block_ids.extend(value)
            else:
                setattr(msg, key, value)
        with pytest.raises(InvalidArgument):
            KVHandle.from_proto(msg)
    msg = handle.to_proto()
    msg.ClearField("layout")
    with pytest.raises(InvalidArgument):
        KVHandle.from_proto(msg)
    msg = handle.to_proto()
    msg.layout.num_layers = 0
    with pytest.raises(InvalidArgument):
        KVHandle.from_proto(msg)


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpc_moves_gpu_kv_between_gpu_engines(llama_dir: Path, dtype: str) -> None:
    """Both engines on CUDA: the KV leaves GPU memory, crosses the wire as raw bytes and lands
    in the decode engine's GPU pool bit-exact; decoding continues like a colocated GPU run."""
    model = {"device": "cuda", "dtype": dtype}
    prompts = {"r-long": prompt(40, 21), "r-short": prompt(5, 22)}

    def on_the_gpu(got: KVExport, want: KVExport) -> None:
        assert want.k.is_cuda and got.k.dtype == want.k.dtype == DTYPES[dtype]

    async def main() -> dict[str, list[int]]:
        async with pair(llama_dir, **model) as p:
            return await fetch_exact_then_decode(p, prompts, on_the_gpu)

    got = run(main())
    for rid, ids in prompts.items():
        assert got[rid] == colocated(llama_dir, rid, ids, **model), rid
