"""`GrpcKVSender` behind a real KVServer: damaged chunks are refused by the client, and a fetch
streams beside a busy engine thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgpack
import pytest
import torch

from cluster.errors import Unavailable
from cluster.kv_transfer.grpc import grpc_kv_sender
from cluster.kv_transfer.kv_frame import decode_frame, encode_frame
from tests.cluster.kv_transfer.kv_pair import colocated, pair, prompt, run
from tests.engine_kv import export_kv


def test_corrupted_or_mislabelled_chunks_are_refused_as_unavailable(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk damaged between the pool and the decode side fails the fetch as a malformed
    stream (Unavailable, so the router may retry from prefill); the lease survives it. Damaged
    bytes are seen with `checksum` on; headers and sizes are checked either way."""
    good_frame = grpc_kv_sender._frame

    def flip_a_byte(r, data, dtype, checksum):
        frame = bytearray(good_frame(r, data, dtype, checksum))
        frame[-1] ^= 0x10
        return bytes(frame)

    def lie_about_nbytes(r, data, dtype, checksum):
        raw, body = decode_frame(good_frame(r, data, dtype, checksum))
        header = msgpack.unpackb(raw)
        header["nbytes"] += 4
        return encode_frame(msgpack.packb(header), bytes(body) + bytes(4))

    def bad_frame(r, data, dtype, checksum):
        return good_frame(r, data, dtype, checksum)[:-1]

    async def main() -> None:
        async with pair(llama_dir) as p:
            ids = prompt(40, 11)
            handle = await p.prefill_handle("r1", ids)
            for checksum, tamper, match in [
                (True, flip_a_byte, "checksum"),
                (False, lie_about_nbytes, "needs .* bytes"),
                (False, bad_frame, "KVChunk|past the end"),
            ]:
                monkeypatch.setattr(grpc_kv_sender, "_frame", tamper)
                p.client.checksum = checksum
                with pytest.raises(Unavailable, match=match):
                    await p.client.fetch(handle, p.decode.layout)
            monkeypatch.setattr(grpc_kv_sender, "_frame", good_frame)
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
            want = await p.prefill.call(lambda e: export_kv(e, "r1"))
            gate = threading.Event()
            busy = asyncio.ensure_future(p.prefill.call(lambda e: gate.wait(30)))
            try:
                got = await asyncio.wait_for(p.client.fetch(handle, p.decode.layout), 10)
                assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
                assert await asyncio.wait_for(p.client.release(handle, "fetched"), 10)
                assert p.leases.fetched == 1 and p.leases.outstanding() == 1  # not yet freed
                assert not busy.done()
            finally:
                gate.set()
            await busy
            assert await p.leases.drain(5.0) and (await p.used_blocks())[0] == 0

    run(main())
