"""`NixlKVClient`: the decode worker's end of the `nixl` KV transport (contract: `KVClient`).

The decode engine's whole KV pool is registered with a NIXL agent when the client is made
(`NixlPool`). Per prefill endpoint, against a live lease: `ConnectNixl` (authorized by the
handle's token and lease) returns the prefill agent's metadata and its pool's geometry, which
`NixlPool.add_peer` checks against our layout before building the peer's descriptors. Per
transfer: `HoldKV` pins the lease (the server checks token, layouts and lease exactly as for
`FetchKV`), then one READ moves the K and V of every layer of the handle's blocks from the
prefill pool straight into the blocks the caller reserved (`fetch_into`): no copy through
Python bytes, no gRPC data stream. The hold ends (the call is cancelled) only once the READ is
complete.

The pair's connection lasts as long as our leases with that endpoint (`leases`: from a
transfer's start to its `release`, or its failure): when the last one ends the peer is removed
(`remove_remote_agent`: its UCX endpoints and unpacked keys go), as the server drops our access
(`NixlKVSender`); a hold the server refuses for that reason (ABORTED) connects again, once.

All agent calls run on one worker thread, one at a time (the agent is not thread-safe); a READ
of a 2k-token prompt is tens of milliseconds of memory copy, which must not block the event
loop. `fetch` (new tensors, for callers without a pool) registers them for the one READ.

Control calls and `release` go through the worker's `KVControl` (one gRPC channel per prefill
endpoint); handles whose transport is the baseline are fetched by the `fallback` client. A peer that
cannot be loaded (NIXL refuses its metadata; the pools cannot reach each other) is remembered and
its handles are fetched over gRPC instead, which every KV server serves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time

import grpc
import torch

from cluster.engine.kv_cache import KVCache, KVExport, KVLayout
from cluster.errors import FailedPrecondition, InvalidArgument, PdServeError, Unavailable
from cluster.kv_transfer.base import KVClient, settle
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto
from cluster.kv_transfer.kv_server_stubs import rpc_error
from cluster.kv_transfer.kv_wire import DTYPES
from cluster.kv_transfer.nixl.nixl_pool import NixlPool, Peer, Region
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

log = logging.getLogger("ray.serve." + __name__)


class NixlKVClient(KVClient):
    def __init__(
        self,
        pool: KVCache | None,
        timeout_s: float,
        *,
        control: KVControl,
        fallback: KVClient,
        max_blocks: int = 1 << 16,
        idle_seconds: float = 60.0,
        telemetry: bool = False,
    ) -> None:
        """Registers `pool` (the decode engine's) for `fetch_into`; without one, only `fetch`
        READs (into tensors it registers per call). `control` carries its control calls,
        `fallback` fetches the handles it does not READ. Unavailable if NIXL is not usable
        here."""
        self.control = control
        self.fallback = fallback
        self.stubs = control.stubs
        self.timeout_s = timeout_s
        self.max_blocks = max_blocks
        self.idle_seconds = idle_seconds
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "pdserve-kv-nixl")
        self.pool = pool
        self.agent: NixlPool | None = None  # made with the first layout seen, if no pool
        self.region: Region | None = None
        if pool is not None:
            self.agent = NixlPool(pool.layout, "decode", telemetry)
            self.region = self.agent.register(pool.k, pool.v)
        self._telemetry = telemetry
        self.peers: dict[str, tuple[Peer, float]] = {}  # endpoint -> (peer, last used)
        self.leases: dict[str, set[str]] = {}  # endpoint -> request ids read, not yet released
        self.connects = 0  # ConnectNixl calls that succeeded
        self.unreachable: set[str] = set()  # endpoints fetched over gRPC instead
        self._connecting: dict[str, asyncio.Lock] = {}
        self.descriptors_posted = 0  # after NIXL's merging (with telemetry)

    async def fetch(self, handle: KVHandle, receiver_layout: KVLayout) -> KVExport:
        """The KV of `handle` in new tensors (registered for this READ only)."""
        if not self._uses_nixl(handle):
            return await self.fallback.fetch(handle, receiver_layout)
        self._check(handle, receiver_layout)
        n = len(handle.block_ids)
        shape = (receiver_layout.num_layers, n, *receiver_layout.block_shape)
        k = torch.empty(shape, dtype=DTYPES[receiver_layout.dtype])
        v = torch.empty_like(k)
        if self.agent is None:
            self.agent = await self._run(NixlPool, receiver_layout, "decode", self._telemetry)
        scratch = await self._run(self.agent.register, k, v)
        try:
            await self._read(handle, receiver_layout, scratch, list(range(n)))
        except _UseGrpc:
            return await self.fallback.fetch(handle, receiver_layout)
        except BaseException:
            self._lease_over(handle)
            raise
        finally:
            await self._run(self.agent.unregister, scratch)
        return KVExport(receiver_layout, handle.num_tokens, k, v)

    async def fetch_into(self, handle: KVHandle, pool: KVCache, block_ids: list[int]) -> int:
        """READ the KV of `handle` into `block_ids` of `pool`, the pool this client registered
        (any other pool: fetch, then copy). Waits for the READ even if cancelled."""
        if not self._uses_nixl(handle) or pool is not self.pool or self.region is None:
            return await super().fetch_into(handle, pool, block_ids)
        self._check(handle, pool.layout)
        if len(block_ids) != len(handle.block_ids):
            raise InvalidArgument(f"{len(block_ids)} blocks reserved for {handle.block_ids}")
        try:
            await self._read(handle, pool.layout, self.region, block_ids)
        except _UseGrpc:
            return await super().fetch_into(handle, pool, block_ids)
        except BaseException:
            self._lease_over(handle)
            raise
        return 2 * pool.layout.num_layers * len(block_ids) * self.region.block_bytes

    async def release(self, handle: KVHandle, reason: str) -> bool:
        """ReleaseKV, as for every transport (`KVControl.release`); the pair's connection goes
        with its last lease."""
        try:
            return await self.control.release(handle, reason)
        finally:
            self._lease_over(handle)

    async def close(self) -> None:
        await self.fallback.close()
        await self.control.close()
        self.peers.clear()
        self.leases.clear()
        if self.agent is not None:
            await self._run(self.agent.close)
        self._thread.shutdown(wait=True)

    # -- one transfer ------------------------------------------------------------------------

    def _uses_nixl(self, handle: KVHandle) -> bool:
        return handle.transport == "nixl" and handle.endpoint not in self.unreachable

    def _check(self, handle: KVHandle, layout: KVLayout) -> None:
        layout.check_matches(handle.layout)
        if layout.dtype not in DTYPES:
            raise FailedPrecondition(f"KV dtype {layout.dtype!r} is not supported")
        if len(handle.block_ids) > self.max_blocks:
            raise InvalidArgument(
                f"KV of {len(handle.block_ids)} blocks is over the cap of {self.max_blocks}"
            )

    async def _read(
        self, handle: KVHandle, layout: KVLayout, region: Region, block_ids: list[int]
    ) -> None:
        """Hold the lease, READ it into `block_ids` of `region`, end the hold. A peer whose
        agent changed (the server restarted on the same endpoint) is loaded again, once."""
        request = pb.HoldKVRequest(
            handle=handle.to_proto(),
            receiver_layout=layout_to_proto(layout),
            reader_agent=self.agent.name,
        )
        self.leases.setdefault(handle.endpoint, set()).add(handle.request_id)
        for attempt in range(2):
            peer = await self._peer(handle, layout)
            call = self.stubs.stub(handle.endpoint).HoldKV(request, timeout=self.timeout_s)
            try:
                held = await call.read()
                if held is grpc.aio.EOF:
                    raise Unavailable(f"KV server {handle.endpoint} ended the hold at once")
                if held.agent_name != peer.name:
                    self._forget(handle.endpoint)
                    if attempt:
                        raise Unavailable(f"NIXL agent of {handle.endpoint} keeps changing")
                    continue
                remote = list(handle.block_ids)
                posted = await settle(
                    self._run(self.agent.read, peer, region, block_ids, remote, self.timeout_s)
                )
                self.descriptors_posted += posted
                self._touch(handle.endpoint)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED and not attempt:  # our access ended
                    self._forget(handle.endpoint)
                    continue
                raise rpc_error(exc, handle) from None
            except Unavailable:  # the peer's agent disconnected: load it again next time
                self._forget(handle.endpoint)
                raise
            finally:
                call.cancel()

    async def _peer(self, handle: KVHandle, layout: KVLayout) -> Peer:
        """The loaded peer of `handle.endpoint`, connected once."""
        endpoint = handle.endpoint
        lock = self._connecting.setdefault(endpoint, asyncio.Lock())
        async with lock:
            entry = self.peers.get(endpoint)
            if entry is not None:
                return entry[0]
            await self._evict_idle()
            request = pb.ConnectNixlRequest(
                handle=handle.to_proto(),
                receiver_layout=layout_to_proto(layout),
                reader_agent=self.agent.name,
            )
            try:
                desc = await self.stubs.stub(endpoint).ConnectNixl(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise rpc_error(exc, handle) from None
            self.connects += 1
            try:
                peer = await self._run(self.agent.add_peer, desc)
            except Unavailable as exc:
                log.warning("NIXL cannot reach %s (%s); using gRPC", endpoint, exc.message)
                self.unreachable.add(endpoint)
                raise _UseGrpc from None
            except PdServeError as exc:
                raise type(exc)(f"NIXL pool of {endpoint}: {exc.message}") from None
            self.peers[endpoint] = (peer, time.monotonic())
            return peer

    def _lease_over(self, handle: KVHandle) -> None:
        """We will not read `handle` again: drop the pair's connection with its last lease."""
        leases = self.leases.get(handle.endpoint)
        if leases is None:
            return
        leases.discard(handle.request_id)
        if not leases:
            del self.leases[handle.endpoint]
            self._forget(handle.endpoint)

    def _forget(self, endpoint: str) -> None:
        entry = self.peers.pop(endpoint, None)
        if entry is not None:
            self._thread.submit(self.agent.remove_peer, entry[0].name)

    def _touch(self, endpoint: str) -> None:
        entry = self.peers.get(endpoint)
        if entry is not None:
            self.peers[endpoint] = (entry[0], time.monotonic())

    async def _evict_idle(self) -> None:
        horizon = time.monotonic() - max(self.idle_seconds, self.timeout_s)
        for endpoint in [e for e, (_, used) in self.peers.items() if used < horizon]:
            self._forget(endpoint)

    async def _run(self, fn, *args):
        """`fn(*args)` on the agent's worker thread."""
        return await asyncio.wrap_future(self._thread.submit(fn, *args))


class _UseGrpc(Exception):
    """The peer is unreachable over NIXL: fetch this handle over gRPC."""
