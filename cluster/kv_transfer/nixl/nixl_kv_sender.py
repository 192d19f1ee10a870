"""`NixlKVSender`: the prefill side of the `nixl` KV transport (contract: `KVSender`): the
ConnectNixl and HoldKV RPCs. ConnectNixl checks the handle (token, a live lease, layouts), then
`describe`s the pool to the reader agent the request names; HoldKV checks and pins the lease
(`lease_pins.pin_slice`) and `hold`s it, for a reader that holds access. The reader's layout
may name a head slice of this pool (a decode rank of another tensor-parallel size, which READs
only those heads: `nixl_ranks`).

At start it registers the engine's whole KV pool with a NIXL agent (`NixlPool`). It never sends
anything itself: `describe` hands a decode worker the agent's metadata and the pool's geometry,
and `hold` keeps a lease pinned (the caller pinned it) while the decode worker READs its blocks,
for as long as the decode worker keeps the call open or until `timeout_s`. While any reader may
be active (a hold, or the wire-up after a `describe`) a background task lets the agent
progress, which UCX needs on the target side for connection set-up and TCP.

Access is bounded by leases (`ReaderAccess`): a reader is given the metadata only against a
live lease, keeps access while any lease it connected or held with is live, and loses it when
the last one ends (fetched, cancelled, aborted or expired: `LeasePins.on_end`); its next HoldKV
is then refused (`PairDropped`, ABORTED) until it connects again with a live lease. NIXL READs
are one-sided: this agent never loads a reader's metadata, so it holds no connection of its own
to drop; the reader drops its connection (`remove_remote_agent`) when told. What this does and
does not protect: docs/architecture.md, "NIXL trust model".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from cluster.engine.kv_cache import KVLayout
from cluster.errors import InvalidArgument, PdServeError
from cluster.kv_transfer.base import KVSender
from cluster.kv_transfer.kv_handle import KVHandle, layout_from_proto
from cluster.kv_transfer.lease_pins import (
    SenderParts,
    abort,
    check_live,
    generated_handlers,
    pin_slice,
)
from cluster.kv_transfer.nixl.nixl_pool import NixlPool
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferServicer

# 1 ms: uvloop (Ray's actor loop) rounds a timer down to whole milliseconds, so 0.5 ms made this a
# busy loop there (a core whole while a lease was held); plain asyncio's clock gave ~1 ms anyway.
PROGRESS_INTERVAL_S = 0.001
WIREUP_S = 2.0  # progress this long after a describe, for the reader's connection set-up


class NixlKVSender(KVSender, KVTransferServicer):
    def __init__(self, parts: SenderParts) -> None:
        """Registers the engine's pool; a hold lasts at most `parts.channel_timeout_s`.
        Unavailable if NIXL is not usable in this process."""
        self.parts = parts
        self.pool = NixlPool(parts.layout, "prefill")
        kv_pool = parts.async_engine.kv_pool
        self.region = self.pool.register(kv_pool.k, kv_pool.v)
        self.timeout_s = parts.channel_timeout_s
        self.holds = 0
        self.access = ReaderAccess()
        parts.leases.on_end(self.access.lease_ended)
        self._progress_until = 0.0
        self._progress: asyncio.Task | None = None

    def handlers(self) -> dict[str, dict[str, grpc.RpcMethodHandler]]:
        return {self.SERVICE: generated_handlers(self, ("ConnectNixl", "HoldKV"))}

    async def ConnectNixl(
        self, request: pb.ConnectNixlRequest, context: grpc.aio.ServicerContext
    ) -> pb.NixlPool:
        try:
            reader = reader_agent(request)
            handle = await check_live(self.parts, request.handle)
            if not request.HasField("receiver_layout"):
                raise InvalidArgument("ConnectNixl needs receiver_layout")
            check_heads(self.parts.layout, layout_from_proto(request.receiver_layout), handle)
            self.access.grant(reader, handle.request_id)
            return self.describe()
        except PdServeError as exc:
            await abort(context, exc)

    async def HoldKV(
        self, request: pb.HoldKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KVHeld]:
        try:
            reader = reader_agent(request)
            rid, _, _ = await pin_slice(self.parts, request)
        except PdServeError as exc:
            await abort(context, exc)
        try:
            try:
                self.access.extend(reader, rid)
            except PdServeError as exc:
                await abort(context, exc)
            async for held in self.hold():
                yield held
        finally:
            self.parts.leases.end_fetch(rid)

    def describe(self) -> pb.NixlPool:
        """The agent and pool, for a decode worker about to connect (its wire-up follows)."""
        self._progress_until = max(self._progress_until, time.monotonic() + WIREUP_S)
        self._keep_progressing()
        return self.pool.describe(self.region)

    async def hold(self) -> AsyncIterator[pb.KVHeld]:
        """Yields one `KVHeld`, then waits until the caller closes the stream (the decode
        worker's READ is complete) or `timeout_s` passes. The caller keeps the lease pinned
        until this ends."""
        self.holds += 1
        self._keep_progressing()
        try:
            yield pb.KVHeld(agent_name=self.pool.name)
            await asyncio.sleep(self.timeout_s)
        finally:
            self.holds -= 1

    async def stop(self) -> None:
        task, self._progress = self._progress, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self.pool.close()

    def _keep_progressing(self) -> None:
        if self._progress is None or self._progress.done():
            self._progress = asyncio.get_running_loop().create_task(self._run_progress())

    async def _run_progress(self) -> None:
        while self.holds or time.monotonic() < self._progress_until:
            self.pool.progress()
            await asyncio.sleep(PROGRESS_INTERVAL_S)


class PairDropped(PdServeError):
    """HoldKV from a reader that holds no access (never connected, or its last lease ended).
    Only on the wire: the reader drops its connection, connects again and holds again."""

    grpc_code = "ABORTED"


class ReaderAccess:
    """Which reader agents were given this pool's metadata, and for which live leases. A reader
    is granted access by a ConnectNixl (against a live lease), extends it with each lease it
    holds, and loses it when the last of those leases ends."""

    def __init__(self) -> None:
        self.readers: dict[str, set[str]] = {}  # reader agent -> live lease ids
        self._leases: dict[str, set[str]] = {}  # lease id -> readers given access by it
        self.dropped = 0  # readers whose last lease ended

    def grant(self, reader: str, request_id: str) -> None:
        self.readers.setdefault(reader, set()).add(request_id)
        self._leases.setdefault(request_id, set()).add(reader)

    def extend(self, reader: str, request_id: str) -> None:
        """PairDropped unless `reader` holds access; else `request_id` keeps it too."""
        if reader not in self.readers:
            raise PairDropped(f"NIXL reader {reader!r} holds no access: ConnectNixl again")
        self.grant(reader, request_id)

    def lease_ended(self, request_id: str) -> None:
        for reader in self._leases.pop(request_id, ()):
            leases = self.readers[reader]
            leases.discard(request_id)
            if not leases:
                del self.readers[reader]
                self.dropped += 1


def check_heads(ours: KVLayout, receiver: KVLayout, handle: KVHandle) -> None:
    """FailedPrecondition unless `receiver` is a head slice of our pool (all of it, between
    pools of one TP size; `KVLayout.check_serves`) and `handle` is of our replica's model at our
    TP size, as `pin_slice` checks a hold's."""
    ours.check_serves(receiver)
    whole = replace(ours, kv_head_start=0, num_kv_heads=ours.total_kv_heads)
    whole.check_matches(
        replace(handle.layout, kv_head_start=0, num_kv_heads=handle.layout.total_kv_heads)
    )


def reader_agent(request) -> str:
    """The request's `reader_agent` (InvalidArgument unless 1 to 256 characters)."""
    if not 0 < len(request.reader_agent) <= 256:
        raise InvalidArgument("a NIXL request names its reader_agent, 1 to 256 characters")
    return request.reader_agent
