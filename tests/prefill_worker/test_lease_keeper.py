"""`LeaseKeeper`'s own contract, on a real prefill engine behind a KV server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from cluster.errors import InvalidArgument, NotFound, Unauthenticated
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferStub
from cluster.request import Request
from tests.cluster.kv_transfer.kv_pair import PARAMS, pair, prompt, run


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


def test_a_grant_cancelled_frees_the_prompt_instead_of_leasing_it(llama_dir: Path) -> None:
    """The prefill call was cancelled between the end of its prefill and its lease: nobody
    will ever see the lease, so there must be none, and the held prompt goes at once."""

    async def main() -> None:
        async with pair(llama_dir) as p:
            request = Request("r1", prompt(40, 3), PARAMS, prefill_only=True)
            assert [o async for o in await p.prefill.generate(request)][-1].finished
            assert (await p.used_blocks())[0] == 3
            grant = asyncio.ensure_future(p.leases.grant("r1"))
            await asyncio.sleep(0)  # the grant waits for the engine thread
            grant.cancel()
            with pytest.raises(asyncio.CancelledError):
                await grant
            assert p.leases.outstanding() == 0
            for _ in range(50):
                if await p.used_blocks() == (0, 0):
                    break
                await asyncio.sleep(0.02)
            assert await p.used_blocks() == (0, 0)

    run(main())


def test_leases_ended_are_counted_by_reason_and_told_to_the_listeners_once(
    llama_dir: Path,
) -> None:
    now = [0.0]

    async def main() -> None:
        async with pair(llama_dir, lease_seconds=1.0, clock=lambda: now[0]) as p:
            told: list[str] = []
            p.leases.on_end(told.append)
            p.leases.on_end(lambda rid: 1 / 0)  # a broken listener costs no lease its end
            for i, reason in enumerate(["cancelled", "cancelled", "aborted", "fetched"]):
                await p.prefill_handle(f"r{i}", prompt(20, i))
                assert await p.leases.release(f"r{i}", reason)
                assert not await p.leases.release(f"r{i}", reason)
            await p.prefill_handle("r4", prompt(20, 4))
            assert await p.leases.cancel("r4")
            await p.prefill_handle("r5", prompt(20, 5))
            now[0] = 5.0
            assert await p.leases.expire_now() == 1
            assert p.leases.ended == {"fetched": 1, "cancelled": 3, "aborted": 1, "expired": 1}
            assert told == ["r0", "r1", "r2", "r3", "r4", "r5"]

    run(main())


def test_cancel_prefill_ends_the_request_wherever_it_is_on_the_worker(llama_dir: Path) -> None:
    """CancelPrefill by request id, as a router sends it when the result of a prefill call it
    cancelled may have been dropped: a leased prompt's lease ends ("cancelled"), a prefilled
    prompt not yet leased is freed, a grant awaiting the engine frees instead of leasing, and a
    prompt still prefilling is aborted. Only a router with the cluster secret may cancel."""

    async def main() -> None:
        async with pair(llama_dir) as p:
            cap = p.leases.capability

            async def cancel(rid: str) -> bool:
                return await p.client.control.cancel_prefill(p.endpoint, rid, cap.cancel_token(rid))

            async def freed() -> bool:
                for _ in range(50):
                    if await p.used_blocks() == (0, 0):
                        return True
                    await asyncio.sleep(0.02)
                return False

            await p.prefill_handle("leased", prompt(20, 1))
            assert await cancel("leased") and not await cancel("leased")  # idempotent
            assert p.leases.ended["cancelled"] == 1 and await freed()

            held = Request("held", prompt(40, 2), PARAMS, prefill_only=True)
            assert [o async for o in await p.prefill.generate(held)][-1].finished
            assert not await cancel("held") and await freed()
            with pytest.raises(NotFound):
                await p.leases.grant("held")

            granting = Request("granting", prompt(40, 3), PARAMS, prefill_only=True)
            assert [o async for o in await p.prefill.generate(granting)][-1].finished
            grant = asyncio.ensure_future(p.leases.grant("granting"))
            await asyncio.sleep(0)  # the grant waits for the engine thread
            # (called directly: an RPC's round trip could outlast the grant)
            assert not await p.leases.cancel("granting")
            with pytest.raises(NotFound):
                await grant
            assert p.leases.outstanding() == 0 and await freed()

            running = Request("running", prompt(120, 4), PARAMS, prefill_only=True)
            outs = asyncio.ensure_future(_outputs(p.prefill.generate(running)))
            await asyncio.sleep(0.01)
            assert not await cancel("running")
            assert (await outs)[-1].finish_reason in ("abort", "prefilled")
            await p.leases.cancel("running")  # had it finished first, this frees it
            assert await freed() and p.leases.outstanding() == 0

            await p.prefill_handle("kept", prompt(20, 5))
            async with grpc.aio.insecure_channel(p.endpoint) as channel:
                stub = KVTransferStub(channel)
                for bad, code in [
                    (pb.CancelPrefillRequest(request_id="kept"), "UNAUTHENTICATED"),
                    (
                        pb.CancelPrefillRequest(
                            request_id="kept", cancel_token=cap.token("kept", [])
                        ),
                        "UNAUTHENTICATED",  # a lease token is not a cancel token
                    ),
                    (
                        pb.CancelPrefillRequest(cancel_token=cap.cancel_token("")),
                        "INVALID_ARGUMENT",
                    ),
                ]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.CancelPrefill(bad)
                    assert err.value.code().name == code
            assert p.leases.outstanding() == 1
            assert await p.leases.release("kept", "aborted")

    run(main())


async def _outputs(stream) -> list:
    return [o async for o in await stream]
