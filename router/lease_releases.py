"""`LeaseReleases`: the router's releases of prefilled prompts' KV leases, sent in the background.

The router gives a lease back when its request ends before a decode worker has the KV:
"cancelled" (the client left, or the deadline passed) or "aborted" (the decode hop failed and
the request is prefilled again or fails). A request that ends must neither wait for the
release nor be able to cancel it, so each one goes out as a task of its own. Best effort: a
release that is lost leaves the lease to expire, the last resort.
"""

from __future__ import annotations

import asyncio
import logging

from cluster.kv_transfer.kv_client import KVClient
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.serving.pool_messages import PrefillResult

log = logging.getLogger(__name__)


class LeaseReleases:
    def __init__(self, kv_client: KVClient) -> None:
        self.kv_client = kv_client
        self._pending: set[asyncio.Task] = set()

    def release(self, handle: KVHandle | None, reason: str) -> None:
        """Send ReleaseKV for `handle` (nothing for None: the request finished in prefill)."""
        if handle is None:
            return
        task = asyncio.ensure_future(self.kv_client.release(handle, reason))
        self._pending.add(task)
        task.add_done_callback(self._sent)

    def release_unclaimed(self, call: asyncio.Future) -> None:
        """A done callback for a prefill call whose caller is gone: the lease of a result that
        landed anyway is released ("cancelled"); a call that failed or was cancelled at the
        replica holds nothing (the replica freed the prompt)."""
        if call.cancelled() or call.exception() is not None:
            return
        result: PrefillResult = call.result()
        self.release(result.handle, "cancelled")

    async def close(self) -> None:
        """Wait for the releases on their way, then close the KV client."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self.kv_client.close()

    def _sent(self, task: asyncio.Task) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("releasing a KV lease failed: %r", task.exception())
