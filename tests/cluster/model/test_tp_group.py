"""The TP communication seam: `SINGLE` is the identity (TP 1 runs no collective), and
`TorchGroup` over gloo sums, gathers and broadcasts between two real processes, refuses
oversized messages, and fails a collective whose peer never comes within its timeout."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from cluster.errors import PdServeError
from cluster.model.parallel.group import SINGLE, TorchGroup, host_store, join_store

CPU = torch.device("cpu")


def test_single_rank_is_the_identity():
    x = torch.randn(3, 5)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x
    msg = {"a": [1, 2]}
    assert SINGLE.broadcast_object(msg) is msg
    assert (SINGLE.rank, SINGLE.world_size) == (0, 1)


def _peer(port: int, mode: str) -> None:
    """Rank 1: exits 0 when its side of `mode` saw what it should."""
    store = join_store("127.0.0.1", port, 2, 60)
    group = TorchGroup(1, 2, store, CPU, timeout_s=20, max_message_bytes=16 << 10)
    if mode == "silent":  # joins, then never takes part in a collective
        time.sleep(30)
        return
    x = group.all_reduce(torch.full((2, 3), 2.0))
    g = group.all_gather(torch.full((2, 1), 2.0))
    msg = group.broadcast_object(timeout_s=None)
    big = group.broadcast_object()  # longer than the one-broadcast head: sent in two
    ok = (
        big == list(range(2000))
        and torch.equal(x, torch.full((2, 3), 3.0))
        and torch.equal(g, torch.tensor([[1.0, 2.0], [1.0, 2.0]]))
        and msg == {"ids": [1, 2, 3], "b": b"\x00\x01", "s": "x"}
    )
    try:  # rank 0 announces 32 KiB, over this rank's 16 KiB limit
        group.broadcast_object()
        ok = False
    except PdServeError:
        pass
    raise SystemExit(0 if ok else 1)


def _start(mode: str):
    store = host_store("127.0.0.1", 2, 60)
    peer = mp.get_context("spawn").Process(target=_peer, args=(store.port, mode), daemon=True)
    peer.start()
    return store, peer


def test_two_ranks_reduce_gather_and_broadcast():
    store, peer = _start("talk")
    try:
        group = TorchGroup(0, 2, store, CPU, timeout_s=20, max_message_bytes=1 << 20)
        x = group.all_reduce(torch.full((2, 3), 1.0))
        assert torch.equal(x, torch.full((2, 3), 3.0))
        g = group.all_gather(torch.full((2, 1), 1.0))
        assert torch.equal(g, torch.tensor([[1.0, 2.0], [1.0, 2.0]]))
        group.broadcast_object({"ids": [1, 2, 3], "b": b"\x00\x01", "s": "x"})
        group.broadcast_object(list(range(2000)))
        with pytest.raises(RuntimeError):  # the peer refuses the size and leaves
            group.broadcast_object(b"x" * (32 << 10))
        peer.join(30)
        assert peer.exitcode == 0
    finally:
        peer.kill()


def test_leader_refuses_an_oversized_message_before_sending():
    group = TorchGroup.__new__(TorchGroup)  # the size check runs before any collective
    group.rank, group.max_message_bytes = 0, 16
    with pytest.raises(PdServeError, match="exceeds"):
        group.broadcast_object(list(range(100)))


def test_collective_times_out_when_the_peer_never_joins():
    store, peer = _start("silent")
    try:
        group = TorchGroup(0, 2, store, CPU, timeout_s=2)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            group.all_reduce(torch.ones(4))
        assert time.monotonic() - start < 15
    finally:
        peer.kill()
