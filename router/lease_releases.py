"""`LeaseReleases`: the router's releases of prefilled prompts' KV leases, sent in the background.

The router gives a lease back when its request ends before a decode worker has the KV:
"cancelled" (the client left, or the deadline passed) or "aborted" (the decode hop failed and
the request is prefilled again or fails). A request that ends must neither wait for the
release nor be able to cancel it, so each one goes out as a task of its own. Best effort: a
release that is lost leaves the lease to expire, the last resort.

A prefill call cancelled while it runs may lose its result on the way back (Serve drops the
result of a call cancelled just after the replica returned it), and with it the handle that
names the worker. `cancel_prefill` covers that case: it sends `CancelPrefill` for the request
id to every prefill worker of the app (their KV endpoints, from the stats registry), and the
one that has the request aborts it or ends its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.serving.pool_messages import PrefillResult

log = logging.getLogger("ray.serve." + __name__)

ENDPOINTS_TTL_S = 1.0  # how long a looked-up list of prefill KV endpoints is used


class LeaseReleases:
    def __init__(
        self,
        kv_client: KVControl,
        capability: Capability,
        prefill_endpoints: Callable[[], Awaitable[list[str]]],
    ) -> None:
        """`prefill_endpoints`: looks up the KV endpoints of the app's prefill workers."""
        self.kv_client = kv_client
        self.capability = capability
        self.prefill_endpoints = prefill_endpoints
        self._endpoints: tuple[float, list[str]] = (-ENDPOINTS_TTL_S, [])
        self._pending: set[asyncio.Task] = set()

    def release(self, handle: KVHandle | None, reason: str) -> None:
        """Send ReleaseKV for `handle` (nothing for None: the request finished in prefill)."""
        if handle is None:
            return
        self._send(self.kv_client.release(handle, reason))

    def release_unclaimed(self, call: asyncio.Future) -> None:
        """A done callback for a prefill call whose caller is gone: the lease of a result that
        landed anyway is released ("cancelled"); a call that failed or was cancelled at the
        replica holds nothing (the replica freed the prompt, or `cancel_prefill` ends it)."""
        if call.cancelled() or call.exception() is not None:
            return
        result: PrefillResult = call.result()
        self.release(result.handle, "cancelled")

    def cancel_prefill(self, request_id: str) -> None:
        """Send CancelPrefill for `request_id` to every prefill worker."""
        self._send(self._cancel_everywhere(request_id))

    async def _cancel_everywhere(self, request_id: str) -> None:
        token = self.capability.cancel_token(request_id)
        endpoints = await self._prefill_endpoints()
        await asyncio.gather(
            *(self.kv_client.cancel_prefill(e, request_id, token) for e in endpoints)
        )

    async def _prefill_endpoints(self) -> list[str]:
        looked_up, endpoints = self._endpoints
        if time.monotonic() - looked_up >= ENDPOINTS_TTL_S:
            endpoints = await self.prefill_endpoints()
            self._endpoints = (time.monotonic(), endpoints)
        return endpoints

    async def close(self) -> None:
        """Wait for the releases on their way, then close the KV client."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        await self.kv_client.close()

    def _send(self, release: Awaitable) -> None:
        task = asyncio.ensure_future(release)
        self._pending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("releasing a KV lease failed: %r", task.exception())
