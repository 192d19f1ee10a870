"""`Deadline`: a request's deadline as one timer, not one per streamed message."""

from __future__ import annotations

import asyncio
import time


class Deadline:
    """A request's deadline: one timer per request, not one per message. When it passes while
    the request's task waits inside `with deadline:` the task is cancelled there (and
    `cancelled_it` says so); at any other moment `expired` is set for the loop to see at its
    next turn. The task is the one that opened the deadline: whoever iterates `generate` does
    so from one task (grpc's call, Serve's replica, the HTTP response)."""

    def __init__(self, at_monotonic: float) -> None:
        loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.expired = False
        self.waiting = False
        self._timer = loop.call_at(loop.time() + (at_monotonic - time.monotonic()), self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self.waiting and self.task is not None:
            self.task.cancel()

    def __enter__(self) -> None:
        self.waiting = True

    def __exit__(self, *exc_info) -> None:
        self.waiting = False

    def cancelled_it(self) -> bool:
        """Whether the CancelledError being handled is this deadline's (then it is taken back
        from the task: the request ends with DeadlineExceeded, not as cancelled)."""
        if not self.expired or self.task is None:
            return False
        return self.task.uncancel() == 0

    def close(self) -> None:
        self._timer.cancel()
