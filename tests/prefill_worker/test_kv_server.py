"""The `grpc` KV transport end to end: a real grpc.aio KVServer on loopback in front of a real
prefill engine, a GrpcKVClient, and a real decode engine that imports the KV and decodes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
import torch

from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVExport
from cluster.errors import FailedPrecondition, InvalidArgument, Unauthenticated, Unavailable
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto
from cluster.kv_transfer.kv_wire import DTYPES, chunk_header, encode_frame
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferStub
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from prefill_worker import kv_server
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

BLOCK_SIZE = 16
# One block of one layer is 2 * 16 * 2 * 16 * 4 = 4 KiB: 8 KiB chunks split layers over blocks.
MAX_CHUNK_BYTES = 8192
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(model_dir) -> Path:
    """The shared tiny Llama (GQA) checkpoint of tests/conftest.py."""
    return model_dir("llama-gqa")


def make_engine(path: Path, **model) -> Engine:
    """A small engine for `path`; `model` overrides ModelConfig fields (device, dtype)."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=32)
    return Engine(EngineConfig(ModelConfig(str(path), **model), cache))


def prompt(length: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 512, (length,), generator=gen).tolist())


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


@dataclass
class Pair:
    """A prefill engine behind a KV server, and a decode engine with a KV client."""

    prefill: AsyncEngine
    decode: AsyncEngine
    leases: LeaseKeeper
    server: KVServer
    client: GrpcKVClient
    endpoint: str

    async def prefill_handle(self, rid: str, ids: tuple[int, ...]) -> KVHandle:
        request = Request(rid, ids, PARAMS, prefill_only=True)
        outs = [out async for out in await self.prefill.generate(request)]
        assert outs[-1].finish_reason == "prefilled"
        block_ids, num_tokens, expiry, token = await self.leases.grant(rid)
        return KVHandle(
            request_id=rid,
            num_tokens=num_tokens,
            endpoint=self.endpoint,
            transport="grpc",
            block_ids=tuple(block_ids),
            block_size=BLOCK_SIZE,
            layout=self.prefill.engine.layout,
            lease_expiry_unix=expiry,
            capability_token=token,
            first_token_id=outs[-1].token_ids[0],
        )

    async def fetch_and_decode(self, handle: KVHandle, ids: tuple[int, ...]) -> list[int]:
        kv = await self.client.fetch(handle, self.decode.engine.layout)
        assert await self.client.release(handle, "fetched")
        request = Request(handle.request_id, ids, PARAMS)
        tokens = [handle.first_token_id]
        stream = await self.decode.import_and_generate(request, kv, handle.first_token_id)
        async for out in stream:
            tokens.extend(out.token_ids)
        return tokens

    async def used_blocks(self) -> tuple[int, int]:
        stats = [
            await e.call(lambda e: e.stats().kv_blocks_used) for e in (self.prefill, self.decode)
        ]
        return stats[0], stats[1]


@asynccontextmanager
async def pair(
    path: Path,
    lease_seconds: float = 30.0,
    clock=time.time,
    expiry_interval: float | None = None,
    **model,
) -> AsyncIterator[Pair]:
    prefill = AsyncEngine(make_engine(path, **model))
    decode = AsyncEngine(make_engine(path, **model))
    prefill.start()
    decode.start()
    leases = LeaseKeeper(prefill, lease_seconds, Capability(b"test-secret"), clock=clock)
    if expiry_interval is not None:
        leases.start(expiry_interval)
    server = KVServer(
        prefill, leases, prefill.engine.layout, "127.0.0.1", 0, max_chunk_bytes=MAX_CHUNK_BYTES
    )
    endpoint = await server.start()
    client = GrpcKVClient(MAX_CHUNK_BYTES, timeout_s=30.0, max_blocks=32)
    p = Pair(prefill, decode, leases, server, client, endpoint)
    try:
        yield p
        assert await leases.drain(5.0), "a lease was never freed"  # frees run in the background
        assert await p.used_blocks() == (0, 0), "KV blocks leaked"
    finally:
        await client.close()
        await server.stop(0)
        await leases.stop()
        await prefill.stop()
        await decode.stop()


async def fetch_exact_then_decode(
    p: Pair, prompts: dict[str, tuple[int, ...]], check: Callable[[KVExport, KVExport], None]
) -> dict[str, list[int]]:
    """Prefill every prompt; fetch the first one's KV once, `check(fetched, the prefill side's
    own export)` and require it bit-exact; then fetch and decode all of them concurrently."""
    handles = {rid: await p.prefill_handle(rid, ids) for rid, ids in prompts.items()}
    first = next(iter(prompts))
    want = await p.prefill.call(lambda e: e.export_kv(first))
    got = await p.client.fetch(handles[first], p.decode.engine.layout)
    check(got, want)
    assert torch.equal(got.k.cpu(), want.k.cpu()) and torch.equal(got.v.cpu(), want.v.cpu())
    tokens = await asyncio.gather(
        *(p.fetch_and_decode(handles[rid], ids) for rid, ids in prompts.items())
    )
    return dict(zip(prompts, tokens, strict=True))


def colocated(path: Path, rid: str, ids: tuple[int, ...], **model) -> list[int]:
    engine = make_engine(path, **model)
    (out,) = engine.generate([Request(rid, ids, PARAMS)])
    assert engine.stats().kv_blocks_used == 0
    return out.token_ids


# -- the happy path ----------------------------------------------------------------------


def test_fetched_kv_decodes_like_a_colocated_run(llama_dir: Path) -> None:
    prompts = {"r-long": prompt(40, 1), "r-exact": prompt(32, 2), "r-short": prompt(3, 3)}

    async def main() -> dict[str, list[int]]:
        async with pair(llama_dir) as p:
            assert p.endpoint.startswith("127.0.0.1:") and not p.endpoint.endswith(":0")
            handles = {rid: await p.prefill_handle(rid, ids) for rid, ids in prompts.items()}
            # The wire copy is bit-exact with the prefill pool's own export.
            h = handles["r-long"]
            want = await p.prefill.call(lambda e: e.export_kv("r-long"))
            got = await p.client.fetch(h, p.decode.engine.layout)
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
                await p.client.fetch(h, p.decode.engine.layout)
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
                await p.client.fetch(forged, p.decode.engine.layout)
            other = Capability(b"other-secret").token("r1", handle.block_ids)
            with pytest.raises(Unauthenticated):
                await p.client.fetch(
                    replace(handle, capability_token=other), p.decode.engine.layout
                )
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
                await p.client.fetch(handle, p.decode.engine.layout)
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
                await p.client.fetch(handle, p.decode.engine.layout)
            assert p.leases.expired == 1 and (await p.used_blocks())[0] == 0

    run(main())


def test_layout_mismatch_is_a_failed_precondition(llama_dir: Path) -> None:
    async def main() -> None:
        async with pair(llama_dir) as p:
            ids = prompt(40, 7)
            handle = await p.prefill_handle("r1", ids)
            # Caught on the decode side, before any network call: the endpoint is unreachable.
            other = replace(p.decode.engine.layout, block_size=32)
            offline = replace(handle, endpoint="127.0.0.1:1")
            with pytest.raises(FailedPrecondition, match="block_size"):
                await p.client.fetch(offline, other)
            # A handle claiming the receiver's (different) layout: the server refuses it.
            other = replace(p.decode.engine.layout, model_id="another-model@123")
            with pytest.raises(FailedPrecondition, match="model_id"):
                await p.client.fetch(replace(handle, layout=other), other)
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)

    run(main())


def test_status_codes_chunk_bounds_and_cancelled_streams_on_the_wire(llama_dir: Path) -> None:
    async def main() -> None:
        async with pair(llama_dir) as p:
            handle = await p.prefill_handle("r1", prompt(40, 10))
            layout = layout_to_proto(p.decode.engine.layout)
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


def test_corrupted_or_mislabelled_chunks_are_refused_as_unavailable(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk damaged between the pool and the decode side fails the fetch as a malformed
    stream (Unavailable, so the router may retry from prefill); the lease survives it."""
    good_frame = kv_server._frame

    def flip_a_byte(r, data, dtype):
        frame = bytearray(good_frame(r, data, dtype))
        frame[-1] ^= 0x10
        return bytes(frame)

    def lie_about_nbytes(r, data, dtype):
        header = msgpack.unpackb(chunk_header(r, data, dtype))
        header["nbytes"] += 4
        return encode_frame(msgpack.packb(header), data.tobytes() + bytes(4))

    def bad_frame(r, data, dtype):
        return good_frame(r, data, dtype)[:-1]

    async def main() -> None:
        async with pair(llama_dir) as p:
            ids = prompt(40, 11)
            handle = await p.prefill_handle("r1", ids)
            for tamper, match in [
                (flip_a_byte, "checksum"),
                (lie_about_nbytes, "needs .* bytes"),
                (bad_frame, "KVChunk|past the end"),
            ]:
                monkeypatch.setattr(kv_server, "_frame", tamper)
                with pytest.raises(Unavailable, match=match):
                    await p.client.fetch(handle, p.decode.engine.layout)
            monkeypatch.setattr(kv_server, "_frame", good_frame)
            assert p.leases.outstanding() == 1
            assert await p.fetch_and_decode(handle, ids) == colocated(llama_dir, "r1", ids)

    run(main())


def test_a_fetch_and_its_release_do_not_wait_for_a_busy_engine_thread(llama_dir: Path) -> None:
    """While the prefill engine thread is stuck in a long step, a fetch streams the whole KV
    and `ReleaseKV` answers; the blocks are freed when the thread gets to it."""

    async def main() -> None:
        async with pair(llama_dir) as p:
            ids = prompt(40, 12)
            handle = await p.prefill_handle("r1", ids)
            want = await p.prefill.call(lambda e: e.export_kv("r1"))
            gate = threading.Event()
            busy = asyncio.ensure_future(p.prefill.call(lambda e: gate.wait(30)))
            try:
                got = await asyncio.wait_for(p.client.fetch(handle, p.decode.engine.layout), 10)
                assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
                assert await asyncio.wait_for(p.client.release(handle, "fetched"), 10)
                assert p.leases.fetched == 1 and p.leases.outstanding() == 1  # not yet freed
                assert not busy.done()
            finally:
                gate.set()
            await busy
            assert await p.leases.drain(5.0) and (await p.used_blocks())[0] == 0

    run(main())


# -- the lease keeper's own contract -----------------------------------------------------


def test_release_during_a_fetch_waits_for_the_fetch(llama_dir: Path) -> None:
    now = [0.0]

    async def main() -> None:
        async with pair(llama_dir, lease_seconds=1.0, clock=lambda: now[0]) as p:
            handle = await p.prefill_handle("r1", prompt(20, 8))
            token = handle.capability_token
            with pytest.raises(Unauthenticated):
                await p.leases.begin_fetch("r1", bytes(32))
            block_ids, num_tokens = await p.leases.begin_fetch("r1", token)
            assert (tuple(block_ids), num_tokens) == (handle.block_ids, 20)
            now[0] = 10.0  # expired, but pinned by the fetch
            assert await p.leases.expire_now() == 0
            assert await p.leases.release("r1", "aborted")
            assert not await p.leases.release("r1", "aborted")  # idempotent
            assert (await p.used_blocks())[0] == 2 and p.leases.outstanding() == 1
            assert not await p.leases.drain(0.05)
            drained = asyncio.create_task(p.leases.drain(5.0))
            p.leases.end_fetch("r1")
            assert await drained
            assert (await p.used_blocks())[0] == 0
            assert (p.leases.aborted, p.leases.expired, p.leases.fetched) == (1, 0, 0)
            with pytest.raises(InvalidArgument):
                await p.leases.release("r1", "whatever")
            assert await p.leases.drain(0.0)  # nothing outstanding

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
