"""`NixlKVSender`'s progress loop on the loop Ray runs replicas on (uvloop): it lets the NIXL
agent progress about once a millisecond while a reader may be active, and is no busy loop
(uvloop rounds a timer down to whole milliseconds: a 0.5 ms sleep there returned at once and
the loop took a core whole). A pool double counts the agent's progress calls."""

from __future__ import annotations

import asyncio

import pytest

from cluster.kv_transfer.nixl.nixl_kv_sender import NixlKVSender


class CountingPool:
    def __init__(self) -> None:
        self.calls = 0

    def progress(self) -> None:
        self.calls += 1


def test_the_progress_loop_polls_about_once_a_millisecond_while_a_lease_is_held():
    uvloop = pytest.importorskip("uvloop")
    sender = NixlKVSender.__new__(NixlKVSender)  # the agent itself is not needed here
    sender.pool, sender.holds, sender._progress_until, sender._progress = (
        CountingPool(),
        1,
        0.0,
        None,
    )

    async def hold_for(seconds: float) -> None:
        sender._keep_progressing()
        await asyncio.sleep(seconds)
        sender.holds = 0  # the hold ends: the loop stops at its next turn
        await sender._progress

    uvloop.run(hold_for(0.3))
    # ~300 at 1 kHz; a busy loop makes tens of thousands in 0.3 s
    assert 30 <= sender.pool.calls <= 900, sender.pool.calls
