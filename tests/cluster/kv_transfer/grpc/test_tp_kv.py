"""KV between tensor-parallel groups of different sizes, on the path the workers take: a prefill
replica of TP k behind a real `KVServer` (rank 0) and rank KV servers (`RankService`, ranks
1..), a decode replica of TP m whose `ShardedKVClient` fetches its heads from the prefill ranks
that hold them and has its other ranks import theirs (`ImportKV`). Greedy output must equal
transformers; leases and blocks must be back to zero on every rank."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from dataclasses import replace

import pytest

from cluster.engine.kv_cache import KVLayout
from cluster.errors import FailedPrecondition, Unauthenticated
from cluster.kv_transfer.grpc.tp_ranks import HeadRun, ShardedKVClient, head_plan, rank_heads
from cluster.request import Request
from tests.conftest import build_checkpoint, greedy, prompt
from tests.tp_pairs import tp_pairs

NEW_TOKENS = 8


def _layout(total: int, tp: int, rank: int) -> KVLayout:
    heads = rank_heads(total, tp, rank)
    return KVLayout("m", "float32", 2, len(heads), 8, 4, heads.start, total, tp)


def test_head_plan_takes_each_head_from_a_rank_that_holds_it():
    # 4 KV heads: P2 -> D1 reads two runs, one from each prefill rank.
    assert head_plan(_layout(4, 2, 0), _layout(4, 1, 0)) == [
        HeadRun(0, 0, 2, 0),
        HeadRun(1, 2, 2, 2),
    ]
    # P1 -> D2: decode rank 1 reads heads 2..3 of the one prefill rank, into its heads 0..1.
    assert head_plan(_layout(4, 1, 0), _layout(4, 2, 1)) == [HeadRun(0, 2, 2, 0)]
    # P4 -> D2 over 2 KV heads (replicated on two prefill ranks each): decode rank 1 takes its
    # head from the second of its holders, so the reads spread.
    assert head_plan(_layout(2, 4, 0), _layout(2, 2, 1)) == [HeadRun(3, 1, 1, 0)]
    with pytest.raises(FailedPrecondition):
        head_plan(_layout(4, 2, 0), replace(_layout(4, 1, 0), head_dim=16))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    gqa = build_checkpoint("llama-gqa", tmp_path_factory.mktemp("tp-kv"))
    # One KV head (MQA): every rank of a TP 2 pool holds a replica of it.
    mqa = build_checkpoint("llama-gqa", tmp_path_factory.mktemp("tp-mqa"), num_key_value_heads=1)
    return {"gqa": gqa, "mqa": mqa}


@pytest.mark.parametrize(
    ("arch", "pair"), [("gqa", (2, 1)), ("gqa", (1, 2)), ("gqa", (2, 2)), ("mqa", (2, 1))]
)
def test_greedy_equals_transformers_across_tp_sizes(checkpoints, hf, arch, pair):
    checkpoint = checkpoints[arch]
    prompts = {f"r{n}": prompt(n, seed=n) for n in (5, 13, 30, 41)}

    async def body():
        with ExitStack() as stack:
            async with tp_pairs(checkpoint, stack, pairs=[pair]) as p:
                runs = (p.decode_one(pair, rid, ids, NEW_TOKENS) for rid, ids in prompts.items())
                return dict(zip(prompts, await asyncio.gather(*runs), strict=True))

    tokens = asyncio.run(asyncio.wait_for(body(), 180))
    for rid, ids in prompts.items():
        hf.assert_greedy(checkpoint, ids, tokens[rid], NEW_TOKENS)


def test_a_rank_server_refuses_a_bad_token_and_a_foreign_import(checkpoints):
    async def body():
        with ExitStack() as stack:
            async with tp_pairs(checkpoints["gqa"], stack, pairs=[(2, 2)]) as p:
                ids = prompt(9, seed=9)
                handle = await p.handle(2, "bad", ids)
                forged = replace(handle, capability_token=b"\0" * 32)
                heads = replace(p.prefill[2].layout, kv_head_start=1)
                client, decode = p.client[2], p.decode[2]
                with pytest.raises(Unauthenticated):
                    await client.slices.fetch_heads(forged, 1, heads)
                outsider = ShardedKVClient(client.inner, client.slices, client.ranks, b"x")
                request = Request("bad", ids, greedy(4))
                block_ids = await decode.call(lambda e: e.reserve_import(request))
                with pytest.raises(Unauthenticated):
                    await outsider.fetch_into(handle, decode.kv_pool, block_ids)
                await decode.call(lambda e: e.cancel_import("bad"))
                assert await client.release(handle, "aborted")

    asyncio.run(asyncio.wait_for(body(), 120))
