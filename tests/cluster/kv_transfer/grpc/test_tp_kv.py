"""KV between tensor-parallel groups of different sizes, on the path the workers take: a prefill
replica of TP k behind a real `KVServer` (rank 0) and rank KV servers (`RankService`, ranks
1..), a decode replica of TP m whose `ShardedKVClient` fetches its heads from the prefill ranks
that hold them and has its other ranks import theirs (`ImportKV`). Greedy output must equal
transformers; leases and blocks must be back to zero on every rank."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest

from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.tp_replica import TPReplica
from cluster.errors import FailedPrecondition, Unauthenticated
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.grpc.rank_server import RankService
from cluster.kv_transfer.grpc.tp_ranks import HeadRun, ShardedKVClient, head_plan, rank_heads
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.request import Request
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper
from tests.conftest import build_checkpoint, engine_config, greedy, prompt

SECRET = "ab" * 32
CHUNK = 1 << 16
NEW_TOKENS = 8


def _service(replica_secret: bytes) -> RankService:
    return RankService("127.0.0.1", SECRET, replica_secret, CHUNK, 30.0)


def _layout(total: int, tp: int, rank: int):
    from cluster.engine.kv_cache import KVLayout

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
        other = _layout(4, 1, 0).__class__(**{**_layout(4, 1, 0).to_dict(), "head_dim": 16})
        head_plan(_layout(4, 2, 0), other)


def _engine(path, tp: int, secret: bytes, stack):
    config = engine_config(path, block_size=4, max_num_batched_tokens=64)
    if tp == 1:
        return Engine(config), ()
    replica = stack.enter_context(TPReplica(config, tp, rank_service=_service(secret)))
    return replica.engine, replica


@asynccontextmanager
async def tp_pair(path, prefill_tp: int, decode_tp: int):
    from contextlib import ExitStack

    with ExitStack() as stack:
        p_engine, p_tp = _engine(path, prefill_tp, b"p", stack)
        d_engine, d_tp = _engine(path, decode_tp, b"d", stack)
        d_engine.imports_every_rank = True
        prefill, decode = AsyncEngine(p_engine), AsyncEngine(d_engine)
        prefill.start()
        decode.start()
        leases = LeaseKeeper(prefill, 30.0, Capability(bytes.fromhex(SECRET)))
        server = KVServer(prefill, leases, prefill.layout, "127.0.0.1", 0, CHUNK)
        endpoint = await server.start()
        if p_tp:
            p_tp.publish_leader(endpoint)
        ranks = d_tp.rank_endpoints if d_tp else ()
        inner = GrpcKVClient(CHUNK, 30.0, max_blocks=d_engine.kv_cache.num_blocks)
        slices = GrpcKVClient(CHUNK, 30.0, max_blocks=d_engine.kv_cache.num_blocks)
        client = ShardedKVClient(inner, slices, ranks, b"d")
        pair = _Pair(prefill, decode, leases, endpoint, p_tp.rank_endpoints if p_tp else (), client)
        try:
            yield pair
            assert await leases.drain(5.0), "a lease was never freed"
            for e in (prefill, decode):
                assert await e.call(lambda e: e.stats().kv_blocks_used) == 0, "KV blocks leaked"
        finally:
            await client.close()
            await server.stop(0)
            await leases.stop()
            await prefill.stop()
            await decode.stop()


class _Pair:
    def __init__(self, prefill, decode, leases, endpoint, rank_endpoints, client):
        self.prefill, self.decode, self.leases = prefill, decode, leases
        self.endpoint, self.rank_endpoints, self.client = endpoint, rank_endpoints, client

    async def handle(self, rid: str, ids) -> KVHandle:
        request = Request(rid, ids, greedy(NEW_TOKENS), prefill_only=True)
        outs = [out async for out in await self.prefill.generate(request)]
        assert outs[-1].finish_reason == "prefilled"
        block_ids, num_tokens, expiry, token = await self.leases.grant(rid)
        return KVHandle(
            request_id=rid,
            num_tokens=num_tokens,
            endpoint=self.endpoint,
            transport="grpc",
            block_ids=tuple(block_ids),
            block_size=4,
            layout=self.prefill.layout,
            lease_expiry_unix=expiry,
            capability_token=token,
            first_token_id=outs[-1].token_ids[0],
            rank_endpoints=self.rank_endpoints,
        )

    async def decode_one(self, rid: str, ids) -> list[int]:
        handle = await self.handle(rid, ids)
        request = Request(rid, ids, greedy(NEW_TOKENS))
        first = handle.first_token_id
        block_ids = await self.decode.call(lambda e: e.reserve_import(request))
        try:
            await self.client.fetch_into(handle, self.decode.kv_pool, block_ids)
        except BaseException:
            await self.decode.call(lambda e: e.cancel_import(rid))
            await self.client.release(handle, "aborted")
            raise
        assert await self.client.release(handle, "fetched")
        tokens = [first]
        async for out in await self.decode._stream(rid, lambda e: e.finish_import(rid, first)):
            tokens.extend(out.token_ids)
        return tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint("llama-gqa", tmp_path_factory.mktemp("tp-kv"))


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2), (2, 2)])
def test_greedy_equals_transformers_across_tp_sizes(checkpoint, hf, prefill_tp, decode_tp):
    prompts = {f"r{n}": prompt(n, seed=n) for n in (5, 13, 30, 41)}

    async def body():
        async with tp_pair(checkpoint, prefill_tp, decode_tp) as p:
            got = await asyncio.gather(*(p.decode_one(rid, ids) for rid, ids in prompts.items()))
        return dict(zip(prompts, got, strict=True))

    tokens = asyncio.run(asyncio.wait_for(body(), 180))
    for rid, ids in prompts.items():
        hf.assert_greedy(checkpoint, ids, tokens[rid], NEW_TOKENS)


def test_a_rank_server_refuses_a_bad_token_and_a_foreign_import(checkpoint):
    async def body():
        async with tp_pair(checkpoint, 2, 2) as p:
            ids = prompt(9, seed=9)
            handle = await p.handle("bad", ids)
            forged = KVHandle(**{**handle.__dict__, "capability_token": b"\0" * 32})
            heads = p.prefill.layout.__class__(**{**p.prefill.layout.to_dict(), "kv_head_start": 1})
            with pytest.raises(Unauthenticated):
                await p.client.slices.fetch_heads(forged, 1, heads)
            outsider = ShardedKVClient(p.client.inner, p.client.slices, p.client.ranks, b"x")
            block_ids = await p.decode.call(
                lambda e: e.reserve_import(Request("bad", ids, greedy(4)))
            )
            with pytest.raises(Unauthenticated):
                await outsider.fetch_into(handle, p.decode.kv_pool, block_ids)
            await p.decode.call(lambda e: e.cancel_import("bad"))
            assert await p.client.release(handle, "aborted")

    asyncio.run(asyncio.wait_for(body(), 120))
