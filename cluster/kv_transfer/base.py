"""The two ends every KV transport implements, and what each is built from.

`KVClient` is the decode side. Ownership contract, the same for every transport:

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

`KVSender` is the prefill side: the handlers of the transport's RPCs, which the prefill
worker's KV server mounts beside its own (ReleaseKV, CancelPrefill). Contract:

- Before it reads a lease's blocks, a handler checks the presented handle and pins its lease
  (`lease_pins.pin`: token, layouts, lease live); the pin lasts while anything may read those
  blocks and is then ended (`LeasePins.end_fetch`), also when the call fails or is cancelled.
  It never ends the lease itself: the decode side releases it (ReleaseKV) or it expires.
- Reads of the pool go through `AsyncEngine.read_held_kv`, beside the engine thread.
- A refusal is a pdserve error turned into the call's status (`lease_pins.abort`).
- `start` runs once the server is bound, on its event loop; `stop` ends whatever the sender
  runs in the background and unpins what it still holds.

Both are built by their transport's package (`registry`) from `ClientParts` / `SenderParts`.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import grpc
    import torch

    from cluster.config import TransferConfig
    from cluster.engine.kv_cache import KVCache, KVExport, KVLayout
    from cluster.kv_transfer.kv_control import KVControl
    from cluster.kv_transfer.kv_handle import KVHandle

T = TypeVar("T")


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


@dataclass(frozen=True)
class ClientParts:
    """What a decode worker's KV client is built from: the transfer settings, the decode
    engine's `device` and KV `pool` (None: `fetch` only), `max_blocks` (the most one fetch may
    allocate), `control` (the gRPC channels to every KV server, for control calls and
    ReleaseKV, shared by all the clients of one worker) and `fallback`, the baseline
    transport's client for handles that name it (None when building the baseline itself)."""

    transfer: TransferConfig
    device: torch.device
    max_blocks: int
    pool: KVCache | None
    control: KVControl
    fallback: KVClient | None = None


class KVSender(ABC):
    """The prefill side of one transport (contract: this module's docstring)."""

    SERVICE = "pdserve.v1.KVTransfer"

    @abstractmethod
    def handlers(self) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
        """The RPC handlers this transport serves: {service name: {method name: handler}}."""

    async def start(self) -> None:  # noqa: B027 (most senders have nothing to start)
        """Called once the server is bound, on its event loop."""

    async def stop(self) -> None:  # noqa: B027
        """End background work; unpin every lease still pinned."""


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
