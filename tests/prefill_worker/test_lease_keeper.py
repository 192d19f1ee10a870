"""`LeaseKeeper`'s own contract, on a real prefill engine behind a KV server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from cluster.errors import InvalidArgument, Unauthenticated
from tests.prefill_worker.kv_pair import pair, prompt, run


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
