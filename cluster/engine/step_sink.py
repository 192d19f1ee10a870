"""`StepSink`: where `AsyncEngine.stream_to` hands one request's outputs, on the output thread
(the decode pool's is `decode_worker.token_sender.StreamSink`), and the connection it queues
them on (`Flushable`), flushed once per step for all the step's sinks on it.

Contract: `put` sees the request's outputs in step order, the last one finished; a request the
engine failed, alone or with the engine, gets `fail` (on the event loop thread) instead of its
last output and no more after it. `done` resolves once the last output was taken and fails if
delivery broke (the engine then aborts the request and frees its blocks).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from cluster.request import StepOutput


class Flushable(Protocol):
    def flush(self) -> list[str]:
        """Send what the step's sinks queued; return the request ids whose streams broke."""


class StepSink(Protocol):
    """Takes one request's outputs on the output thread. `done` (an asyncio future of the
    consuming loop) resolves once the last output was taken and fails if delivery broke."""

    done: asyncio.Future

    def put(self, out: StepOutput) -> Flushable | None: ...

    def fail(self, exc: BaseException) -> None:
        """Event loop thread: the request will get no more outputs."""
