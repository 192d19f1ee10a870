"""`CancelledIds`: the request ids a prefill worker was told to cancel before it knew them.

A router cancels a prefill call it no longer needs both through Serve (the call itself) and by
`CancelPrefill` to every prefill worker; the call may still be queued on its way to a replica
when the cancel lands there, and would then be prefilled and leased for nobody. So a cancel
that finds nothing is remembered, and the request, when it arrives, is dropped before the
engine sees it (`PrefillWorker.prefill`) and never leased (`LeaseKeeper.grant`).

Bounds: an id is kept `keep_seconds` (the lease period: past it, a lease granted for nobody
expires anyway) and at most `max_ids` ids are kept; beyond that the oldest goes first, so a
burst of cancels larger than the bound may forget some early, and those requests fall back on
lease expiry. Only a holder of the cluster secret can cancel (the cancel token), so the bound
is a memory ceiling, not a defence. Runs on one event loop; not thread-safe.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

MAX_CANCELLED_IDS = 65536


class CancelledIds:
    def __init__(
        self,
        keep_seconds: float,
        max_ids: int = MAX_CANCELLED_IDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if keep_seconds <= 0 or max_ids <= 0:
            raise ValueError("keep_seconds and max_ids must be positive")
        self.keep_seconds = keep_seconds
        self.max_ids = max_ids
        self.clock = clock
        self.dropped = 0  # requests refused because their cancel came first
        self._at: OrderedDict[str, float] = OrderedDict()  # id -> when cancelled, oldest first

    def add(self, request_id: str) -> None:
        """Remember `request_id` as cancelled from now on."""
        now = self.clock()
        self._at.pop(request_id, None)
        self._at[request_id] = now
        self._prune(now)

    def __contains__(self, request_id: str) -> bool:
        at = self._at.get(request_id)
        return at is not None and self.clock() - at < self.keep_seconds

    def __len__(self) -> int:
        return len(self._at)

    def drop(self, request_id: str) -> bool:
        """Whether an arriving `request_id` is to be dropped (its cancel came first); counts
        those that are."""
        if request_id not in self:
            return False
        self.dropped += 1
        return True

    def _prune(self, now: float) -> None:
        while self._at:
            oldest, at = next(iter(self._at.items()))
            if len(self._at) <= self.max_ids and now - at < self.keep_seconds:
                return
            del self._at[oldest]
