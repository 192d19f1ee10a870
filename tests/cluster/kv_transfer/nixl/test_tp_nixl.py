"""KV between tensor-parallel groups of different sizes over NIXL, on the path the workers take
(`tests/tp_pairs.py` with transport "nixl"): every rank registers its own pool with its own
agent; each decode rank READs exactly its heads from the prefill rank(s) that hold them
(`NixlHeads`; a prefill rank 1.. serves them from its `RankServer`, holding the lease on rank 0
through `PinKV`). Greedy output must equal transformers, every byte must have come by NIXL
READs (each rank's READ bytes are counted), and leases and blocks must be back to zero on every
rank. A forged token or a foreign import is still refused; a peer NIXL cannot load falls back
to the head-sliced gRPC path."""

from __future__ import annotations

import asyncio
import math
from contextlib import ExitStack
from dataclasses import replace

import grpc
import pytest
import torch

from cluster.engine.kv_cache import KVCache, KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument, Unauthenticated, Unavailable
from cluster.kv_transfer.grpc.tp_ranks import ShardedKVClient
from cluster.kv_transfer.head_plan import HeadRun, source_layout
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import layout_to_proto
from cluster.kv_transfer.nixl.nixl_pool import NixlPool, load_nixl
from cluster.kv_transfer.nixl.nixl_ranks import NixlHeads, head_rows, row_indices
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.request import Request
from tests.conftest import build_checkpoint, greedy, prompt
from tests.tp_pairs import BLOCK_SIZE, tp_pairs

try:
    load_nixl()
except Exception:  # pragma: no cover - nixl is a dependency on Linux x86_64
    pytest.skip("NIXL is not installed here", allow_module_level=True)

NEW_TOKENS = 8


def test_head_rows_address_exactly_the_run_of_heads():
    # [layers, blocks, block_size, heads, head_dim]: the rows of heads 1..2 of block 2, token 3
    # of layer 1's V must start at that element and span two heads.
    k = torch.zeros((2, 5, 4, 4, 8))
    v = torch.zeros_like(k)
    item = k.element_size()
    desc = pb.NixlPool(
        k_base=k.data_ptr(),
        v_base=v.data_ptr(),
        layer_stride=k.stride(0) * item,
        block_stride=k.stride(1) * item,
        block_bytes=k[0, 0].numel() * item,
        num_layers=2,
        num_blocks=5,
    )
    rows = head_rows(desc, 4, 4, 1, 2, per_token=True)
    assert rows.shape == (2 * 2 * 4, 5)
    row = rows[(1 * 2 + 1) * 4 + 3]  # V, layer 1, token 3
    assert row[0] + 2 * row[3] == v[1, 2, 3, 1].data_ptr()
    assert row[1] == 2 * 8 * item and row[4] == 5
    whole = head_rows(desc, 4, 4, 0, 4, per_token=False)
    assert whole.shape == (4, 5) and whole[1][0] == k[1].data_ptr()
    # Blocks 3 and 1 of a 16-row list: row-major, the same order on both sides of a READ.
    assert list(row_indices([3, 1], 5, 2)) == [3, 1, 8, 6]


def test_a_peer_description_or_block_id_off_the_layout_is_refused_before_any_read():
    """What a prefill rank's server sends (its pool's description) and what a handle names
    (its block ids) are checked against that rank's layout before NIXL sees them."""
    ours = KVLayout("m", "float32", 2, 1, 8, 4, 1, 2, 2)  # decode rank 1 of TP 2: head 1
    pool = KVCache(ours, 6, torch.float32, torch.device("cpu"))
    source = KVLayout("m", "float32", 2, 2, 8, 4)  # a TP 1 prefill pool: heads 0..1
    theirs = KVCache(source, 3, torch.float32, torch.device("cpu"))
    heads = NixlHeads(pool, KVControl(1 << 20, 5.0), None, 5.0, 60.0)
    target = NixlPool(source, "target")
    try:
        desc = target.describe(target.register(theirs.k, theirs.v))
        heads._start_agent()
        for bad, error in (
            (replace_desc(desc, block_bytes=desc.block_bytes // 2), FailedPrecondition),
            (replace_desc(desc, num_layers=3), FailedPrecondition),
            (replace_desc(desc, num_blocks=0), InvalidArgument),
            (replace_desc(desc, block_stride=1), InvalidArgument),
            (replace_desc(desc, k_base=(1 << 64) - 16), InvalidArgument),
        ):
            with pytest.raises(error):
                heads._load(bad, source)
        peer = heads._load(desc, source)
        run = HeadRun(0, 1, 1, 0)
        with pytest.raises(InvalidArgument, match="peer"):
            heads._post(peer, run, [0], [desc.num_blocks])  # the handle's block off their pool
        heads._unload(peer)
    finally:
        heads._close_agent()
        target.close()


def replace_desc(desc: pb.NixlPool, **fields) -> pb.NixlPool:
    out = pb.NixlPool()
    out.CopyFrom(desc)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint("llama-gqa", tmp_path_factory.mktemp("tp-nixl"))


def _rank_bytes(layout: KVLayout, num_tokens: int) -> int:
    """The KV bytes of a decode rank's heads (`layout`: every rank of a replica holds as many)
    of a prompt of `num_tokens` tokens."""
    blocks = math.ceil(num_tokens / BLOCK_SIZE)
    return 2 * layout.num_layers * blocks * BLOCK_SIZE * layout.num_kv_heads * layout.head_dim * 4


@pytest.mark.parametrize("pair", [(2, 1), (1, 2), (2, 2)])
def test_greedy_equals_transformers_over_nixl_reads(checkpoint, hf, pair):
    prompts = {f"r{n}": prompt(n, seed=n) for n in (5, 13, 30, 41)}
    m = pair[1]

    async def body():
        with ExitStack() as stack:
            async with tp_pairs(checkpoint, stack, pairs=[pair], transport="nixl") as p:
                client = p.client[m]
                assert isinstance(client.heads, NixlHeads)
                runs = (p.decode_one(pair, rid, ids, NEW_TOKENS) for rid, ids in prompts.items())
                tokens = dict(zip(prompts, await asyncio.gather(*runs), strict=True))
                moved, descriptors = list(client.nixl_bytes), client.heads.descriptors
                if m > 1:
                    await _foreign_import_refused(p, pair)
                return tokens, moved, p.decode[m].layout, descriptors

    tokens, nixl_bytes, layout, descriptors = asyncio.run(asyncio.wait_for(body(), 180))
    for rid, ids in prompts.items():
        hf.assert_greedy(checkpoint, ids, tokens[rid], NEW_TOKENS)
    # Every rank READ exactly its heads of every prompt over NIXL: nothing came over gRPC.
    assert len(nixl_bytes) == m
    for rank in range(m):
        expect = sum(_rank_bytes(layout, len(ids)) for ids in prompts.values())
        assert nixl_bytes[rank] == expect, (rank, nixl_bytes, expect)
    # Descriptors: per (K or V, layer, block, token) of each head run; where a run is every head
    # of both pools (P2 -> D2), per (K or V, layer, block).
    runs, per_token = {(2, 1): (2, True), (1, 2): (1, True), (2, 2): (1, False)}[pair]
    blocks = sum(math.ceil(len(ids) / BLOCK_SIZE) for ids in prompts.values())
    assert descriptors == runs * 2 * layout.num_layers * blocks * (BLOCK_SIZE if per_token else 1)


def test_nixl_refusals_and_the_grpc_fallback(checkpoint, hf):
    pair = (2, 1)

    async def body():
        with ExitStack() as stack:
            async with tp_pairs(checkpoint, stack, pairs=[pair], transport="nixl") as p:
                client, decode = p.client[1], p.decode[1]
                ids = prompt(9, seed=9)
                handle = await p.handle(2, "bad", ids)
                request = Request("bad", ids, greedy(4))
                block_ids = await decode.call(lambda e: e.reserve_import(request))
                try:
                    # A forged token: the prefill ranks' ConnectNixl refuse it.
                    forged = replace(handle, capability_token=b"\0" * 32)
                    with pytest.raises(Unauthenticated):
                        await client.heads.fetch_heads(forged, decode.kv_pool, block_ids)
                    # Rank 1 serves only its own heads: rank 0's are FAILED_PRECONDITION.
                    stub = client.heads.stubs.stub(handle.rank_endpoint(1))
                    wrong = source_layout(handle, 0)
                    call = stub.ConnectNixl(
                        pb.ConnectNixlRequest(
                            handle=handle.to_proto(),
                            receiver_layout=layout_to_proto(wrong),
                            reader_agent="someone",
                        ),
                        timeout=10,
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call
                    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                finally:
                    await decode.call(lambda e: e.cancel_import("bad"))
                    assert await client.release(handle, "aborted")
                # A peer NIXL cannot load: its runs go over gRPC, the output is still right.
                heads = client.heads

                def refuse(desc, source):
                    raise Unavailable("this peer cannot be reached (test)")

                heads._load = refuse
                before = list(client.nixl_bytes)
                fallback_ids = prompt(21, seed=21)
                got = await p.decode_one(pair, "fb", fallback_ids, NEW_TOKENS)
                assert client.nixl_bytes == before, "the fallback must not count NIXL bytes"
                assert len(heads.unreachable) == 2
                return fallback_ids, got

    ids, got = asyncio.run(asyncio.wait_for(body(), 180))
    hf.assert_greedy(checkpoint, ids, got, NEW_TOKENS)


async def _foreign_import_refused(p, pair) -> None:
    """ImportKV with another replica's secret is refused by the decode rank 1.., and nothing is
    READ for it."""
    k, m = pair
    client, decode = p.client[m], p.decode[m]
    ids = prompt(9, seed=9)
    handle = await p.handle(k, "foreign", ids)
    outsider = ShardedKVClient(client.inner, client.slices, client.ranks, b"x", client.heads)
    request = Request("foreign", ids, greedy(4))
    block_ids = await decode.call(lambda e: e.reserve_import(request))
    try:
        with pytest.raises(Unauthenticated):
            await outsider.fetch_into(handle, decode.kv_pool, block_ids)
    finally:
        await decode.call(lambda e: e.cancel_import("foreign"))
        assert await client.release(handle, "aborted")
    assert outsider.nixl_bytes[1:] == [0] * (m - 1)
