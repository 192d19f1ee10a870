"""`NixlPool`: a peer's pool description is checked field by field against the reader's layout
before NIXL sees any of it, and descriptors select exactly the named blocks."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from cluster.engine.kv_cache import KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument, Unavailable
from cluster.kv_transfer.nixl.nixl_pool import NixlPool, check_description, load_nixl
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

try:
    load_nixl()
except Exception:  # pragma: no cover - nixl is a dependency on Linux x86_64
    pytest.skip("NIXL is not installed here", allow_module_level=True)

LAYOUT = KVLayout("m", "float32", 3, 2, 8, 4)  # blocks of 4 * 2 * 8 * 4 = 256 bytes


def pool_tensors(num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, num_blocks, *LAYOUT.block_shape)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@pytest.fixture(scope="module")
def source():
    pool = NixlPool(LAYOUT, "test-source")
    region = pool.register(*pool_tensors(10, 0))
    yield pool, region
    pool.close()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"num_layers": 4}, FailedPrecondition, "layers"),
        ({"block_bytes": 512}, FailedPrecondition, "bytes"),
        ({"mem_type": "FILE"}, InvalidArgument, "mem_type"),
        ({"device_id": 1}, InvalidArgument, "device_id"),
        ({"agent_name": ""}, InvalidArgument, "agent name"),
        ({"agent_metadata": b""}, InvalidArgument, "metadata"),
        ({"agent_metadata": bytes(2 << 20)}, InvalidArgument, "metadata"),
        ({"num_blocks": 0}, InvalidArgument, "blocks"),
        ({"block_stride": 8}, InvalidArgument, "strides"),
        ({"layer_stride": 256}, InvalidArgument, "strides"),
        ({"k_base": 0}, InvalidArgument, "addresses"),
        ({"v_base": (1 << 64) - 1024}, InvalidArgument, "addresses"),
    ],
)
def test_a_malformed_or_foreign_description_is_refused_before_nixl_sees_it(
    source, change, error, match
) -> None:
    pool, region = source
    desc = pool.describe(region)
    for name, value in change.items():
        setattr(desc, name, value)
    with pytest.raises(error, match=match):
        check_description(desc, LAYOUT)


def test_a_description_nixl_cannot_parse_is_unavailable(source) -> None:
    pool, region = source
    reader = NixlPool(LAYOUT, "test-reader")
    try:
        desc = pool.describe(region)
        desc.agent_metadata = b"not nixl metadata" * 8
        with pytest.raises(Unavailable):
            reader.add_peer(desc)
        assert not reader.peers
        other = replace(LAYOUT, head_dim=16)
        with pytest.raises(FailedPrecondition):
            check_description(pool.describe(region), other)
    finally:
        reader.close()


def test_a_read_copies_exactly_the_named_blocks_in_order(source) -> None:
    pool, region = source
    k_src, v_src = region._tensors
    reader = NixlPool(LAYOUT, "test-reader")
    try:
        k, v = torch.zeros(3, 6, *LAYOUT.block_shape), torch.zeros(3, 6, *LAYOUT.block_shape)
        local = reader.register(k, v)
        peer = reader.add_peer(pool.describe(region))
        remote_blocks, local_blocks = [7, 2, 3, 9], [5, 0, 1, 3]
        with concurrent.futures.ThreadPoolExecutor(1) as thread:
            done = thread.submit(reader.read, peer, local, local_blocks, remote_blocks, 5.0)
            while not done.done():  # the source progresses for the reader's wire-up
                pool.progress()
                time.sleep(1e-3)
            done.result()
        for src, dst in zip(remote_blocks, local_blocks, strict=True):
            assert torch.equal(k[:, dst], k_src[:, src]) and torch.equal(v[:, dst], v_src[:, src])
        assert not k[:, [2, 4]].any()  # blocks not named stay untouched
        with pytest.raises(InvalidArgument, match="out of range"):
            reader.read(peer, local, [0], [10], 1.0)
    finally:
        reader.close()


def _serve_pool(conn) -> None:
    """A source pool in a process of its own: sends its description, then progresses."""
    pool = NixlPool(LAYOUT, "test-dying-source")
    region = pool.register(*pool_tensors(10, 1))
    conn.send_bytes(pool.describe(region).SerializeToString())
    while True:
        pool.progress()
        time.sleep(1e-3)


def test_a_read_from_a_peer_that_died_is_unavailable_at_once() -> None:
    """NIXL raises its own error (nixlRemoteDisconnectError) when the peer's process is gone;
    the read turns it into Unavailable, which makes the router prefill the request again
    elsewhere, rather than an INTERNAL error that fails it (seen in CI: a prefill replica
    killed as its KV was read)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_serve_pool, args=(theirs,), daemon=True)
    child.start()
    reader = NixlPool(LAYOUT, "test-reader")
    try:
        assert ours.poll(60), "the source process did not start"
        desc = pb.NixlPool.FromString(ours.recv_bytes())
        local = reader.register(*pool_tensors(6, 2))
        peer = reader.add_peer(desc)
        assert reader.read(peer, local, [0, 1], [2, 3], 10.0) == 2 * 2 * LAYOUT.num_layers
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        started = time.monotonic()
        with pytest.raises(Unavailable, match="NIXL read from"):
            reader.read(peer, local, [0, 1], [2, 3], 10.0)
        assert time.monotonic() - started < 5.0  # not left to the read's timeout
    finally:
        reader.close()
        if child.is_alive():
            child.kill()
