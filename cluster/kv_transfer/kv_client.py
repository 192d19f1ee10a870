"""`KVClient`: the decode side of every KV transport, and `make_kv_client`, which picks one.

Ownership contract, the same for every transport:

- A `KVHandle` names KV that a prefill replica holds under a lease. It stays fetchable until
  the lease ends: released ("fetched" or "aborted", by anyone holding the handle) or expired at
  `handle.lease_expiry_unix`. After that a fetch fails with Unavailable; it never reads blocks
  the prefill side may have reused. A handle may be fetched more than once while its lease lives.
- `fetch(handle, receiver_layout)` returns a `KVExport` whose tensors are new and belong to the
  caller (nothing else writes or frees them). It does not end the lease: the prefill replica
  keeps the blocks pinned until `release` or expiry.
- `release(handle, reason)` may be called at any time: "fetched" once `fetch` has returned (the
  data is already in the caller's tensors), "aborted" when the request is given up, with or
  without a fetch. It is best effort and idempotent: False if nothing was freed or the call
  failed (the lease then expires on its own).
- `close()` ends the client's channels; no call may follow it.

Errors of `fetch`, as pdserve errors: a layout mismatch is FailedPrecondition (raised before any
network call when the handle already shows it); a bad token is Unauthenticated; an expired,
released or unknown lease, an unreachable server or a malformed transfer is Unavailable (the
router may retry the request from prefill); a fetch over the client's timeout is
DeadlineExceeded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from cluster.config import TransferConfig
    from cluster.engine.kv_cache import KVExport, KVLayout
    from cluster.kv_transfer.kv_handle import KVHandle


class KVClient(ABC):
    @abstractmethod
    async def fetch(self, handle: KVHandle, receiver_layout: KVLayout) -> KVExport:
        """The KV of `handle`, checked against `receiver_layout`. The lease stays held."""

    @abstractmethod
    async def release(self, handle: KVHandle, reason: str) -> bool:
        """End the lease ("fetched" or "aborted"). Best effort: False if nothing was freed."""

    @abstractmethod
    async def close(self) -> None:
        """Close every channel this client opened."""


def make_kv_client(transfer: TransferConfig, device: torch.device, max_blocks: int) -> KVClient:
    """The KV client for `transfer.transport`, chosen once, when a decode worker starts;
    `device` is the decode engine's, `max_blocks` caps what one fetch may allocate."""
    # Imported here: both implementations import this module for `KVClient`.
    from cluster.kv_transfer.collective_kv_client import CollectiveKVClient
    from cluster.kv_transfer.grpc_kv_client import GrpcKVClient

    args = (transfer.max_chunk_bytes, transfer.fetch_timeout_seconds)
    idle = transfer.channel_idle_seconds
    if transfer.transport == "grpc":
        return GrpcKVClient(*args, max_blocks=max_blocks, idle_seconds=idle)
    return CollectiveKVClient(
        transfer.transport, device, *args, max_blocks=max_blocks, idle_seconds=idle
    )
