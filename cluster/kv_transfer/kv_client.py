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
- `fetch_into(handle, pool, block_ids)` writes the same KV straight into blocks of the caller's
  pool, which the caller reserved (`Engine.reserve_import`) and frees if it raises. It returns
  only once nothing writes those blocks any more, even when cancelled (a cancelled transfer is
  waited for), so the caller may free them at once. The `nixl` transport READs into the pool
  with no copy on the way; the others fetch and then copy the KV in.
- `close()` ends the client's channels; no call may follow it.

Errors of `fetch`, as pdserve errors: a layout mismatch is FailedPrecondition (raised before any
network call when the handle already shows it); a bad token is Unauthenticated; an expired,
released or unknown lease, an unreachable server or a malformed transfer is Unavailable (the
router may retry the request from prefill); a fetch over the client's timeout is
DeadlineExceeded.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

from cluster.errors import Unavailable

if TYPE_CHECKING:
    import torch

    from cluster.config import TransferConfig
    from cluster.engine.kv_cache import KVCache, KVExport, KVLayout
    from cluster.kv_transfer.kv_handle import KVHandle

T = TypeVar("T")
log = logging.getLogger("ray.serve." + __name__)


class KVClient(ABC):
    @abstractmethod
    async def fetch(self, handle: KVHandle, receiver_layout: KVLayout) -> KVExport:
        """The KV of `handle`, checked against `receiver_layout`. The lease stays held."""

    async def fetch_into(self, handle: KVHandle, pool: KVCache, block_ids: list[int]) -> int:
        """Write the KV of `handle` into `block_ids` of `pool` (token order); returns its bytes.
        The lease stays held. Here: `fetch`, then one copy into the pool on a worker thread."""
        kv = await self.fetch(handle, pool.layout)
        await settle(asyncio.to_thread(pool.write, block_ids, kv.k, kv.v))
        return kv.k.nbytes + kv.v.nbytes

    @abstractmethod
    async def release(self, handle: KVHandle, reason: str) -> bool:
        """End the lease ("fetched" or "aborted"). Best effort: False if nothing was freed."""

    @abstractmethod
    async def close(self) -> None:
        """Close every channel this client opened."""


def make_kv_client(
    transfer: TransferConfig, device: torch.device, max_blocks: int, pool: KVCache | None = None
) -> KVClient:
    """The KV client for `transfer.transport`, chosen once, when a decode worker starts;
    `device` is the decode engine's, `max_blocks` caps what one fetch may allocate, `pool` is
    the engine's KV pool (the `nixl` client registers it for `fetch_into`)."""
    # Imported here: the implementations import this module for `KVClient`.
    from cluster.kv_transfer.collective_kv_client import CollectiveKVClient
    from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
    from cluster.kv_transfer.nixl_kv_client import NixlKVClient

    args = (transfer.max_chunk_bytes, transfer.fetch_timeout_seconds)
    idle = transfer.channel_idle_seconds
    if transfer.transport == "grpc":
        return GrpcKVClient(
            *args, max_blocks=max_blocks, idle_seconds=idle, checksum=transfer.checksum
        )
    if transfer.transport == "nixl":
        try:
            return NixlKVClient(pool, *args, max_blocks=max_blocks, idle_seconds=idle)
        except Unavailable as exc:  # every KV server serves FetchKV too
            log.warning("KV client falls back to grpc: %s", exc.message)
            return GrpcKVClient(*args, max_blocks=max_blocks, idle_seconds=idle)
    return CollectiveKVClient(
        transfer.transport, device, *args, max_blocks=max_blocks, idle_seconds=idle
    )


async def settle(work: Awaitable[T]) -> T:
    """Await `work` to its end even if the caller is cancelled meanwhile (then re-raise the
    cancellation): for transfers that write memory the caller frees once this returns."""
    future = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if not future.done():
                cancelled = True
                continue
            raise
    if cancelled:
        raise asyncio.CancelledError
    return result
