"""`RankNixlSender`: the `nixl` sender of a prefill replica's tensor-parallel rank 1.., in that
rank's KV server (`RankServer`): ConnectNixl and HoldKV over this rank's own NIXL agent and
pool, so a decode rank READs this rank's heads from here, not through rank 0.

It is `NixlKVSender` over the rank's pool and `LeaderPins`: every check and pin goes to rank 0,
which owns the leases (ConnectNixl checks the lease is live there; HoldKV keeps it pinned there
through `PinKV` for as long as the hold lasts, and the pin ends with the hold: on success,
failure or timeout). A rank does not see leases end, so a reader's access here is bounded by
time instead (`RankAccess`): it lasts `idle_s` from its last ConnectNixl or HoldKV; then HoldKV
is ABORTED until it connects again, against a live lease.
"""

from __future__ import annotations

import time

from cluster.kv_transfer.lease_pins import SenderParts
from cluster.kv_transfer.nixl.nixl_kv_sender import NixlKVSender, PairDropped


class RankAccess:
    """`ReaderAccess` for a rank 1..: the readers given this pool's metadata, each until
    `idle_s` after it last connected or held."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.readers: dict[str, float] = {}  # reader agent -> when last seen
        self.dropped = 0

    def grant(self, reader: str, request_id: str) -> None:
        self._expire()
        self.readers[reader] = time.monotonic()

    def extend(self, reader: str, request_id: str) -> None:
        """PairDropped unless `reader` holds access; else it lasts `idle_s` from now."""
        self._expire()
        if reader not in self.readers:
            raise PairDropped(f"NIXL reader {reader!r} holds no access: ConnectNixl again")
        self.readers[reader] = time.monotonic()

    def lease_ended(self, request_id: str) -> None:
        pass  # not seen here: rank 0 owns the leases

    def _expire(self) -> None:
        horizon = time.monotonic() - self.idle_s
        for reader in [r for r, seen in self.readers.items() if seen < horizon]:
            del self.readers[reader]
            self.dropped += 1


class RankNixlSender(NixlKVSender):
    def __init__(self, parts: SenderParts) -> None:
        """Registers the rank's pool (`parts.async_engine.kv_pool`) with a new agent; readers'
        access lasts `parts.channel_idle_s`. Unavailable if NIXL is not usable here."""
        super().__init__(parts)
        self.access = RankAccess(parts.channel_idle_s)
