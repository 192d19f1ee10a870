"""`LeaseKeeper`: how long a prefilled prompt's KV blocks stay pinned, and who may read them.

Contract. `grant` puts a lease on a request the engine holds (finish reason "prefilled") and
mints its capability token; a `grant` cancelled before it returns frees the held prompt instead
(its caller is gone, so nobody would ever release it). The blocks stay pinned until exactly one
of:
  (a) `release(rid, "fetched")` - the decode worker holds the data;
  (b) `release(rid, "cancelled")` - the request was cancelled (the client left, or its
      deadline passed) before the decode worker fetched it;
  (c) `release(rid, "aborted")` - the router gave up on the request (a failed decode hop);
  (b') `cancel(rid)` - as (b), for a router that never got the handle (its prefill call was
      cancelled while running, so Serve may drop the result); a grant still awaiting the
      engine frees the prompt instead of leasing it; a cancel that finds the request nowhere
      is remembered (`cancelled`, for at least the lease period), so the request, arriving
      after it, is dropped by the worker and never granted;
  (d) the lease expires (`expire_now`, run every interval by the expiry task): the last
      resort, for a release that never came.
Then the keeper counts the reason (`ended`), tells its `on_end` listeners (a NIXL sender drops
a reader's access with its last lease) and frees them on the engine thread (`Engine.release`);
`release` returns once the lease is ended, without waiting for the engine thread to get to
the free (a busy engine is between steps only now and then), and `outstanding` / `drain`
count the lease until its blocks are free. A fetch brackets its reads with `begin_fetch` /
`end_fetch`: while one is in flight, expiry skips the lease and a release is deferred until
the fetch ends, so blocks are never freed under a reader (the reads need not run on the
engine thread: nothing else frees, reuses or writes a pinned lease's blocks). `begin_fetch`
refuses a lease that is past its expiry even if the expiry task has not run yet, so a late
fetch never reads blocks that may have been reused.

Runs on one event loop; not thread-safe.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from cluster.engine.async_engine import AsyncEngine
from cluster.errors import InvalidArgument, NotFound, Unauthenticated
from cluster.kv_transfer.capability import Capability
from prefill_worker.cancelled_ids import MAX_CANCELLED_IDS, CancelledIds

log = logging.getLogger("ray.serve." + __name__)

RELEASE_REASONS = ("fetched", "cancelled", "aborted")


@dataclass
class _Lease:
    block_ids: list[int]
    num_tokens: int
    expiry: float
    token: bytes
    fetches: int = 0  # fetches in flight; > 0 pins the blocks
    freeing: str | None = None  # release reason, once a release was decided


class LeaseKeeper:
    def __init__(
        self,
        async_engine: AsyncEngine,
        lease_seconds: float,
        capability: Capability,
        clock: Callable[[], float] = time.time,
        max_cancelled_ids: int = MAX_CANCELLED_IDS,
    ) -> None:
        if lease_seconds <= 0:
            raise InvalidArgument(f"lease_seconds must be positive, got {lease_seconds}")
        self.engine = async_engine
        self.lease_seconds = lease_seconds
        self.capability = capability
        self.clock = clock
        self.granted = 0
        self.ended = dict.fromkeys((*RELEASE_REASONS, "expired"), 0)  # leases ended, by reason
        self._leases: dict[str, _Lease] = {}
        self._granting: dict[str, bool] = {}  # grants awaiting the engine: cancelled meanwhile?
        # Cancels that came before their request: kept a lease period, on the keeper's clock.
        self.cancelled = CancelledIds(lease_seconds, max_cancelled_ids, clock)
        self._frees: set[asyncio.Task] = set()
        self._expiry_task: asyncio.Task | None = None
        self._end_listeners: list[Callable[[str], None]] = []
        self._empty = asyncio.Event()
        self._empty.set()

    # -- granting and fetching -------------------------------------------------------------

    async def grant(self, request_id: str) -> tuple[list[int], int, float, bytes]:
        """Lease the held KV of `request_id`: (block ids, num tokens, expiry, token).
        NotFound if the engine holds no KV for it; InvalidArgument if it is leased already.
        Cancelled, it frees the held KV (in the background) instead of leasing it."""
        if request_id in self._leases or request_id in self._granting:
            raise InvalidArgument(f"request {request_id!r} is already leased", param="request_id")
        self._granting[request_id] = False
        try:
            block_ids, num_tokens = await self.engine.call(lambda e: e.held_blocks(request_id))
        except asyncio.CancelledError:
            self._track(self.engine.call(lambda e: e.release(request_id)))
            raise
        finally:
            cancelled = self._granting.pop(request_id)
        if cancelled or request_id in self.cancelled:  # the caller is gone
            self._track(self.engine.call(lambda e: e.release(request_id)))
            raise NotFound(f"request {request_id!r} was cancelled")
        expiry = self.clock() + self.lease_seconds
        token = self.capability.token(request_id, block_ids)
        self._leases[request_id] = _Lease(list(block_ids), num_tokens, expiry, token)
        self._empty.clear()
        self.granted += 1
        return list(block_ids), num_tokens, expiry, token

    async def begin_fetch(self, request_id: str, token: bytes) -> tuple[list[int], int]:
        """Pin a live lease for reading: (block ids, num tokens). Unauthenticated for a wrong
        token, NotFound for an unknown, released or expired lease. Pair with `end_fetch`."""
        lease = self._leases.get(request_id)
        if lease is None or lease.freeing is not None:
            raise NotFound(f"no KV lease for request {request_id!r} (released or expired)")
        if not _same_token(lease.token, token):
            raise Unauthenticated(f"bad capability token for request {request_id!r}")
        if self.clock() >= lease.expiry:
            if lease.fetches == 0:
                self._end(request_id, lease, "expired")
                await self._free(request_id, lease)
            raise NotFound(f"the KV lease of request {request_id!r} expired")
        lease.fetches += 1
        return list(lease.block_ids), lease.num_tokens

    def end_fetch(self, request_id: str) -> None:
        """Unpin after `begin_fetch`; runs a release that arrived during the fetch."""
        lease = self._leases.get(request_id)
        if lease is None or lease.fetches == 0:
            return
        lease.fetches -= 1
        if lease.fetches == 0 and lease.freeing is not None:
            self._free_soon(request_id, lease)

    # -- ending leases ---------------------------------------------------------------------

    async def release(self, request_id: str, reason: str, token: bytes | None = None) -> bool:
        """End a lease (a reason of RELEASE_REASONS). True if this call ended a live lease;
        False if there was none. With `token`, a wrong one raises Unauthenticated. Idempotent.
        The blocks are freed in the background, at once or when the fetch in flight ends."""
        if reason not in RELEASE_REASONS:
            raise InvalidArgument(
                f"release reason must be one of {', '.join(RELEASE_REASONS)}, got {reason!r}"
            )
        lease = self._leases.get(request_id)
        if lease is None or lease.freeing is not None:
            return False
        if token is not None and not _same_token(lease.token, token):
            raise Unauthenticated(f"bad capability token for request {request_id!r}")
        self._end(request_id, lease, reason)
        if lease.fetches == 0:  # else end_fetch frees the blocks
            self._free_soon(request_id, lease)
        return True

    async def cancel(self, request_id: str) -> bool:
        """Cancel `request_id` wherever it is on this worker (`CancelPrefill`): end its lease
        ("cancelled", True), make a grant in flight free the prompt instead, or else abort it
        in the engine if it is queued, prefilling or prefilled but not yet leased (False). An
        id the engine does not know (its request not here yet) is remembered in `cancelled`."""
        if request_id in self._leases:
            return await self.release(request_id, "cancelled")
        if request_id in self._granting:
            self._granting[request_id] = True
            return False
        if not await asyncio.shield(self.engine.call(lambda e: e.abort(request_id))):
            self.cancelled.add(request_id)
        return False

    async def expire_now(self) -> int:
        """Free every unpinned lease past its expiry; returns how many."""
        now = self.clock()
        due = [
            (rid, lease)
            for rid, lease in self._leases.items()
            if lease.expiry <= now and lease.fetches == 0 and lease.freeing is None
        ]
        freed = 0
        for rid, lease in due:
            if lease.freeing is None and lease.fetches == 0:  # unchanged while we awaited
                self._end(rid, lease, "expired")
                await self._free(rid, lease)
                freed += 1
        return freed

    async def _free(self, request_id: str, lease: _Lease) -> None:
        """Free the blocks of a lease whose `freeing` reason is set and that no fetch pins."""
        block_ids = lease.block_ids

        def free(engine) -> bool:
            # Only the sequence this lease was granted on, should the id have been reused.
            try:
                held, _ = engine.held_blocks(request_id)
            except NotFound:
                return False
            return held == block_ids and engine.release(request_id)

        try:
            await asyncio.shield(self.engine.call(free))
        finally:
            if self._leases.get(request_id) is lease:
                del self._leases[request_id]
            if not self._leases:
                self._empty.set()

    def on_end(self, listener: Callable[[str], None]) -> None:
        """Call `listener(request_id)` as each lease ends (`LeasePins.on_end`)."""
        self._end_listeners.append(listener)

    def _end(self, request_id: str, lease: _Lease, reason: str) -> None:
        """Decide a lease's end (once): no fetch may begin after this; counted by reason, and
        told to the `on_end` listeners."""
        lease.freeing = reason
        self.ended[reason] += 1
        for listener in self._end_listeners:
            try:
                listener(request_id)
            except Exception:  # a listener's bug must not keep the lease's blocks
                log.exception("KV lease end listener failed")

    def _free_soon(self, request_id: str, lease: _Lease) -> None:
        self._track(self._free(request_id, lease))

    def _track(self, free: Coroutine) -> None:
        """Run a free in the background; `stop` waits for it."""
        task = asyncio.get_running_loop().create_task(free)
        self._frees.add(task)
        task.add_done_callback(self._frees.discard)

    @property
    def fetched(self) -> int:
        return self.ended["fetched"]

    @property
    def aborted(self) -> int:
        return self.ended["aborted"]

    @property
    def expired(self) -> int:
        return self.ended["expired"]

    # -- background expiry and shutdown ----------------------------------------------------

    def start(self, interval: float = 1.0) -> None:
        """Run `expire_now` every `interval` seconds on the running loop until `stop`."""
        if self._expiry_task is None:
            self._expiry_task = asyncio.get_running_loop().create_task(self.run_expiry(interval))

    async def stop(self) -> None:
        task, self._expiry_task = self._expiry_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._frees:
            await asyncio.gather(*self._frees, return_exceptions=True)

    async def run_expiry(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire_now()
            except Exception:  # keep the loop alive for the leases still to come
                log.exception("KV lease expiry failed")

    def outstanding(self) -> int:
        """Leases whose blocks are not yet freed (live, being fetched or being freed)."""
        return len(self._leases)

    async def drain(self, timeout: float) -> bool:
        """Wait until no lease is outstanding; False if `timeout` seconds pass first."""
        if not self._leases:
            return True
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        return True


def _same_token(expected: bytes, token: object) -> bool:
    return isinstance(token, bytes) and hmac.compare_digest(expected, token)
