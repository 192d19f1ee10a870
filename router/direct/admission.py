"""`Admission`: how many calls a router replica works on at once, and how many may wait for
one, counted across its entries, so that a direct call and a proxied one take from one limit
and queue the same way.

Serve admits a proxied call by its deployment's `max_ongoing_requests` and
`max_queued_requests` (one queued beyond those is refused at once: RESOURCE_EXHAUSTED). The
router (router/router.py) makes one `Admission` of the same two numbers; its `Generate` takes a
slot for every call, and the direct endpoint takes one for every call before it reads the
request (grpc_call.py), so direct streams count toward the router's limit, wait in a bounded
queue (first come, first served) and are refused beyond it, while their request bytes stay
unacknowledged (their HTTP/2 windows hold the client back meanwhile).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any


class Overloaded(Exception):
    """The queue is full (RESOURCE_EXHAUSTED)."""


class Admission:
    """At most `limit` calls at once; at most `queue` more waiting; past that, `refused`."""

    def __init__(self, limit: int, queue: int, refused: type[Exception] = Overloaded) -> None:
        if limit < 1 or queue < 0:
            raise ValueError("an admission limit must be >= 1 and its queue >= 0")
        self.limit = limit
        self.queue = queue
        self.refused = refused
        self.ongoing = 0
        self.waiting: deque[asyncio.Future] = deque()

    @asynccontextmanager
    async def slot(self, context: Any = None) -> AsyncIterator[None]:
        """Hold one slot for the block, waiting in the queue for it. A call its endpoint
        admitted already (its context's `admitted` set: a direct call) takes no second."""
        if getattr(context, "admitted", False):
            yield
            return
        await self.acquire()
        try:
            yield
        finally:
            self.release()

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue; `refused` when the queue is full."""
        if self.ongoing < self.limit and not self.waiting:
            self.ongoing += 1
            return
        if len(self.waiting) >= self.queue:
            raise self.refused(
                f"the router is at its limit of {self.limit} calls and {self.queue} waiting"
            )
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # granted as it was cancelled: pass the slot on
            elif turn in self.waiting:
                self.waiting.remove(turn)
            raise

    def release(self) -> None:
        """Give a slot back: to the first caller waiting, else free."""
        while self.waiting:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on; `ongoing` stays
                return
        self.ongoing -= 1
