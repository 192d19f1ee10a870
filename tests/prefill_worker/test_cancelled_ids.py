"""A cancel that reaches a prefill worker before its request wins (issue 37, point 7): the
request, arriving after it, is dropped before the engine sees it and never leased, and the
worker's memory of such cancels stays within its bounds."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from cluster.errors import NotFound
from cluster.kv_transfer.kv_control import KVControl
from cluster.request import Request
from prefill_worker.cancelled_ids import CancelledIds
from prefill_worker.prefill_worker import PrefillWorker
from tests.cluster.kv_transfer.kv_pair import PARAMS, pair, prompt, run


def test_a_request_that_arrives_after_its_cancel_is_dropped_and_never_leased(
    llama_dir: Path,
) -> None:
    async def main() -> None:
        async with pair(llama_dir) as p:
            cap = p.leases.capability
            control = KVControl(1 << 20, 30.0)  # the router's side of CancelPrefill

            async def cancel(rid: str) -> bool:
                return await control.cancel_prefill(p.endpoint, rid, cap.cancel_token(rid))

            assert not await cancel("early")  # nothing to cancel yet: remembered
            worker = types.SimpleNamespace(draining=False, leases=p.leases, engine=p.prefill)
            request = Request("early", prompt(40, 1), PARAMS)
            with pytest.raises(NotFound, match="cancelled before it arrived"):
                await PrefillWorker.prefill(worker, request)
            steps = await p.prefill.call(lambda e: e.generated_tokens)
            assert steps == 0 and await p.used_blocks() == (0, 0)
            assert p.leases.cancelled.dropped == 1

            # Past the worker's check before the cancel came (its admission still queued):
            # prefilled, but the grant frees it instead of leasing it.
            assert not await cancel("raced")
            raced = Request("raced", prompt(40, 2), PARAMS, prefill_only=True)
            assert [o async for o in await p.prefill.generate(raced)][-1].finished
            assert (await p.used_blocks())[0] == 3
            with pytest.raises(NotFound, match="cancelled"):
                await p.leases.grant("raced")
            assert p.leases.granted == 0 and p.leases.outstanding() == 0

            # Another id is served as ever.
            handle = await p.prefill_handle("other", prompt(20, 3))
            assert p.leases.granted == 1
            assert await p.leases.release(handle.request_id, "aborted")
            await control.close()

    run(main())


def test_the_keeper_remembers_at_most_its_bound_of_cancels(llama_dir: Path) -> None:
    async def main() -> None:
        async with pair(llama_dir) as p:
            p.leases.cancelled = CancelledIds(30.0, max_ids=3, clock=p.leases.clock)
            for i in range(5):
                assert not await p.leases.cancel(f"gone{i}")
            assert len(p.leases.cancelled) == 3
            assert [f"gone{i}" in p.leases.cancelled for i in range(5)] == [
                False,
                False,
                True,
                True,
                True,
            ]

    run(main())


def test_cancelled_ids_are_kept_the_lease_period_then_forgotten() -> None:
    now = [100.0]
    ids = CancelledIds(keep_seconds=30.0, max_ids=4, clock=lambda: now[0])
    ids.add("a")
    now[0] = 129.9
    ids.add("b")
    assert "a" in ids and ids.drop("a") and ids.dropped == 1
    now[0] = 130.0
    assert "a" not in ids and not ids.drop("a") and ids.dropped == 1
    ids.add("c")  # prunes the expired
    assert len(ids) == 2 and "b" in ids
    for rid in "defgh":
        ids.add(rid)
    assert len(ids) == 4 and [r in ids for r in "bcdefgh"] == [False] * 3 + [True] * 4
    ids.add("e")  # again: refreshed, moved to the newest
    ids.add("i")
    assert [r in ids for r in "efghi"] == [True, False, True, True, True]
    with pytest.raises(ValueError):
        CancelledIds(keep_seconds=0.0)
