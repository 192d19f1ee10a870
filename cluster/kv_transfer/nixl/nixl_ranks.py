"""`NixlHeads`: how one rank of a decode replica moves its own KV heads of a handle from a
prefill replica of another tensor-parallel size over NIXL (transport "nixl"): head-sliced
READs, each straight from the prefill rank that holds the heads into this rank's pool. Nothing
is gathered through one rank.

This rank's pool is registered with an agent of its own on the first move across TP sizes.
Per run of the head plan (`cluster.kv_transfer.head_plan`: heads held whole by one prefill
rank), against that rank's KV server (rank 0's `KVServer`, or a rank 1..'s `RankServer`,
which holds the lease on rank 0 through `PinKV`): `ConnectNixl` (its agent's metadata and
its pool's geometry, checked against that rank's layout before any descriptor is built from
it; the peer is loaded once and kept while that server's agent stays the same; when our
access there ends with our last lease there, HoldKV is ABORTED and we connect again, keeping
the loaded peer), then per transfer `HoldKV` with the run's head slice as the receiver's
layout, one READ, and the hold ends (once the READ is complete, or failed, or timed out).
Peers unused for `idle_s` are unloaded.

The pools are `[layers, blocks, block_size, kv_heads, head_dim]`: a run of heads of a block is
`block_size` pieces, one per token, `kv_heads · head_dim` elements apart. So a READ takes one
descriptor per (K or V, layer, block, token) of `count · head_dim` elements; where the run is
every head of both pools (P2 -> D2), one per (K or V, layer, block), as the whole-pool READ
does. Descriptor lists are prepared once per (pool, head offset, head count).

Every number from the wire is checked before use: the pool's description (`check_description`
against the prefill rank's layout: sizes, strides, addresses, block count), the handle's block
ids against that pool, this rank's block ids against its own. A server that does not serve nixl
(UNIMPLEMENTED) or a peer NIXL cannot load is remembered, and its runs go over gRPC
(`fallback`, head-sliced FetchKV). All agent calls run on one worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from cluster.engine.kv_cache import KVCache, KVLayout
from cluster.errors import InvalidArgument, PdServeError, Unavailable
from cluster.kv_transfer.base import settle
from cluster.kv_transfer.head_plan import HeadRun, head_plan, source_layout
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import KVHandle, layout_to_proto
from cluster.kv_transfer.kv_server_stubs import rpc_error
from cluster.kv_transfer.nixl.nixl_pool import (
    NixlPool,
    Region,
    check_description,
    load_nixl,
    pool_rows,
)
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

log = logging.getLogger("ray.serve." + __name__)

_LOCAL = "NIXL_INIT_AGENT"


@dataclass
class HeadPeer:
    """A prefill rank's pool this agent may READ from: its agent, checked description and
    layout, and its descriptor lists by (head offset in its pool, head count, per token)."""

    name: str
    desc: pb.NixlPool
    layout: KVLayout
    dlists: dict[tuple[int, int, bool], Any] = field(default_factory=dict)
    live: bool = True


def head_rows(
    desc: pb.NixlPool, block_size: int, num_heads: int, offset: int, count: int, per_token: bool
) -> np.ndarray:
    """Strided descriptor rows of heads `[offset, offset + count)` of a pool of `num_heads`
    heads (`desc`'s geometry, already checked): rows K layers 0..L-1 then V, each per token of
    a block (or one whole block without `per_token`, then `count == num_heads`); each row is
    `num_blocks` descriptors `block_stride` apart."""
    strides = (desc.layer_stride, desc.block_stride, desc.block_bytes)
    bases = (desc.k_base, desc.v_base)
    rows = pool_rows(bases, desc.num_layers, strides, desc.num_blocks, desc.device_id)
    if not per_token:
        return rows
    token_bytes = desc.block_bytes // block_size
    head_bytes = token_bytes // num_heads
    tokens = np.arange(block_size, dtype=np.uint64) * np.uint64(token_bytes)
    tokens += np.uint64(offset * head_bytes)
    out = np.repeat(rows, block_size, axis=0)  # [2 * num_layers * block_size, 5]
    out[:, 0] = (rows[:, 0][:, None] + tokens[None, :]).reshape(-1)
    out[:, 1] = count * head_bytes
    return out


def row_indices(blocks: list[int], num_blocks: int, num_rows: int) -> np.ndarray:
    """Indexes into a prepared list of `num_rows` rows of `num_blocks` each: every row of every
    block of `blocks`, rows outermost (the same order on both sides of a READ)."""
    rows = np.arange(num_rows, dtype=np.int64)[:, None] * num_blocks
    return (rows + np.asarray(blocks, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)


class NixlHeads:
    def __init__(
        self, pool: KVCache, control: KVControl, fallback, timeout_s: float, idle_s: float
    ) -> None:
        """`pool` (this rank's) is registered with an agent of its own on the first move (a
        replica whose KV never crosses TP sizes makes none). `fallback` (`GrpcHeads`) moves the
        runs of servers NIXL cannot reach, and every run where no agent can be made.
        Unavailable if NIXL does not import here."""
        self.pool = pool
        self.control = control
        self.stubs = control.stubs
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.idle_s = max(idle_s, timeout_s)
        load_nixl()
        self.agent: NixlPool | None = None
        self.region: Region | None = None
        self._own: pb.NixlPool | None = None  # our pool's geometry, for our rows
        self._no_agent = ""  # why no agent could be made, once tried
        self._starting = asyncio.Lock()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "pdserve-kv-nixl-heads")
        self.peers: dict[str, tuple[HeadPeer, float]] = {}  # endpoint -> (peer, last used)
        self.local: dict[tuple[int, int, bool], Any] = {}
        self.unreachable: set[str] = set()  # endpoints whose runs go over gRPC
        self._connecting: dict[str, asyncio.Lock] = {}
        self.connects = 0
        self.read_bytes = 0  # KV bytes READ over NIXL so far
        self.descriptors = 0  # descriptors of those READs

    async def fetch_heads(
        self, handle: KVHandle, pool: KVCache, block_ids: list[int]
    ) -> tuple[int, int]:
        """Move this rank's heads of `handle` into `block_ids` of `pool` (this rank's): (bytes
        written, bytes of them READ over NIXL). Every run is awaited to its end, even when one
        fails (then the first failure is raised)."""
        if pool is not self.pool:
            raise InvalidArgument("NIXL head reads go into the pool they registered")
        runs = head_plan(handle.layout, pool.layout)
        if len(block_ids) != len(handle.block_ids) or len(set(block_ids)) != len(block_ids):
            raise InvalidArgument(f"{len(block_ids)} blocks reserved for {handle.block_ids}")
        if not all(0 <= b < pool.num_blocks for b in block_ids):
            raise InvalidArgument(f"block ids beyond this pool's {pool.num_blocks} blocks")
        results = await settle(
            asyncio.gather(
                *(self._move(handle, block_ids, r) for r in runs), return_exceptions=True
            )
        )
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return sum(n for n, _ in results), sum(x for _, x in results)

    async def _move(self, handle: KVHandle, block_ids: list[int], run: HeadRun) -> tuple[int, int]:
        endpoint = handle.rank_endpoint(run.rank)
        if handle.transport == "nixl" and endpoint not in self.unreachable and await self._ready():
            try:
                nbytes = await self._read(handle, endpoint, run, block_ids)
                return nbytes, nbytes
            except _UseGrpc:
                pass
        return await self.fallback.fetch_run(handle, self.pool, block_ids, run), 0

    async def _read(
        self, handle: KVHandle, endpoint: str, run: HeadRun, block_ids: list[int]
    ) -> int:
        """Hold the lease on `endpoint` for the run's heads, READ them, end the hold. When our
        access there ended (ABORTED: our last lease there ended) we connect again, keeping the
        loaded peer; a peer whose agent changed (the server restarted) is loaded again."""
        source = source_layout(handle, run.rank)
        heads = source.head_slice(run.start, run.count)
        request = pb.HoldKVRequest(
            handle=handle.to_proto(),
            receiver_layout=layout_to_proto(heads),
            reader_agent=self.agent.name,
        )
        regrant = False
        for _ in range(3):
            peer = await self._peer(handle, endpoint, source, heads, regrant)
            call = self.stubs.stub(endpoint).HoldKV(request, timeout=self.timeout_s)
            try:
                held = await call.read()
                if held is grpc.aio.EOF:
                    raise Unavailable(f"KV server {endpoint} ended the hold at once")
                if held.agent_name != peer.name:
                    self._forget(endpoint, peer)
                    continue
                remote = list(handle.block_ids)
                try:
                    nbytes = await settle(self._run(self._post, peer, run, block_ids, remote))
                except _Dropped:  # another read found the peer gone meanwhile: take the new one
                    continue
                self.read_bytes += nbytes
                self._touch(endpoint, peer)
                return nbytes
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:  # our access ended: connect again
                    regrant = True
                    continue
                raise rpc_error(exc, handle) from None
            except Unavailable:  # the peer's agent disconnected: load it again next time
                self._forget(endpoint, peer)
                raise
            finally:
                call.cancel()
        raise Unavailable(f"NIXL access to {endpoint} keeps ending")

    async def _peer(
        self, handle: KVHandle, endpoint: str, source: KVLayout, heads: KVLayout, regrant: bool
    ) -> HeadPeer:
        """The loaded peer of `endpoint`, the KV server of the prefill rank whose pool is laid
        out as `source`: connected once, and again with `regrant` (the loaded peer is kept
        while its agent is the one the server names)."""
        async with self._connecting.setdefault(endpoint, asyncio.Lock()):
            entry = self.peers.get(endpoint)
            if entry is not None and not regrant:
                return entry[0]
            self._evict_idle()
            request = pb.ConnectNixlRequest(
                handle=handle.to_proto(),
                receiver_layout=layout_to_proto(heads),
                reader_agent=self.agent.name,
            )
            try:
                desc = await self.stubs.stub(endpoint).ConnectNixl(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise rpc_error(exc, handle) from None
                log.warning("KV server %s does not serve nixl; its heads go over gRPC", endpoint)
                self.unreachable.add(endpoint)
                raise _UseGrpc from None
            self.connects += 1
            entry = self.peers.get(endpoint)
            if entry is not None:
                if entry[0].name == desc.agent_name:
                    self._touch(endpoint, entry[0])
                    return entry[0]
                self._forget(endpoint, entry[0])
            try:
                peer = await self._run(self._load, desc, source)
            except Unavailable as exc:
                log.warning("NIXL cannot reach %s (%s); using gRPC", endpoint, exc.message)
                self.unreachable.add(endpoint)
                raise _UseGrpc from None
            except PdServeError as exc:
                raise type(exc)(f"NIXL pool of {endpoint}: {exc.message}") from None
            self.peers[endpoint] = (peer, time.monotonic())
            return peer

    async def _ready(self) -> bool:
        """Whether this rank has its agent, made on first use."""
        async with self._starting:
            if self.agent is None and not self._no_agent:
                try:
                    await self._run(self._start_agent)
                except Unavailable as exc:
                    log.warning("no NIXL agent for TP KV moves (%s); using gRPC", exc.message)
                    self._no_agent = exc.message
        return self.agent is not None

    # -- on the agent's thread ---------------------------------------------------------------

    def _start_agent(self) -> None:
        agent = NixlPool(self.pool.layout, "heads")
        try:
            self.region = agent.register(self.pool.k, self.pool.v)
            self._own = agent.describe(self.region)
        except BaseException:
            agent.close()
            raise
        self.agent = agent

    def _load(self, desc: pb.NixlPool, source: KVLayout) -> HeadPeer:
        check_description(desc, source)
        agent = self.agent.agent
        try:
            name = agent.add_remote_agent(desc.agent_metadata)
        except Exception as exc:
            raise Unavailable(f"NIXL cannot load agent {desc.agent_name}: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != desc.agent_name:
            agent.remove_remote_agent(name)
            raise InvalidArgument(f"NIXL metadata names agent {name!r}, not {desc.agent_name!r}")
        try:
            agent.make_connection(name)
        except Exception as exc:
            agent.remove_remote_agent(name)
            raise Unavailable(f"NIXL peer {name} refused: {exc}") from None
        return HeadPeer(name, desc, source)

    def _post(self, peer: HeadPeer, run: HeadRun, local: list[int], remote: list[int]) -> int:
        """READ the run's heads of `remote` blocks of `peer` into `local` blocks of ours; the
        bytes read. Blocks until complete (DeadlineExceeded after `timeout_s`)."""
        if not peer.live:
            raise _Dropped
        if not all(0 <= b < peer.desc.num_blocks for b in remote):
            raise InvalidArgument(f"handle block ids beyond the peer's {peer.desc.num_blocks}")
        ours, theirs = self.pool.layout, peer.layout
        per_token = not run.count == theirs.num_kv_heads == ours.num_kv_heads
        offset = run.start - theirs.kv_head_start
        src = self._dlist(peer.dlists, peer.name, peer.desc, theirs, offset, run.count, per_token)
        dst = self._dlist(self.local, _LOCAL, self._own, ours, run.offset, run.count, per_token)
        num_rows = 2 * ours.num_layers * (ours.block_size if per_token else 1)
        lidx = row_indices(local, self.region.num_blocks, num_rows)
        ridx = row_indices(remote, peer.desc.num_blocks, num_rows)
        try:
            xfer = self.agent.agent.make_prepped_xfer("READ", dst, lidx, src, ridx)
        except Exception as exc:
            raise Unavailable(f"NIXL read from {peer.name} not posted: {exc!r}") from None
        try:
            self.agent.wait(xfer, peer.name, self.timeout_s)
        finally:
            try:
                xfer.release()
            except Exception as exc:  # a transfer to a dead peer may refuse its release
                log.warning("NIXL transfer handle not released: %r", exc)
        self.descriptors += len(lidx)
        item = ours.block_bytes // (2 * ours.num_layers * ours.block_size * ours.num_kv_heads)
        return 2 * ours.num_layers * len(local) * ours.block_size * run.count * item

    def _dlist(self, cache: dict, agent_name: str, desc, layout, offset, count, per_token) -> Any:
        key = (offset, count, per_token)
        if key not in cache:
            rows = head_rows(desc, layout.block_size, layout.num_kv_heads, offset, count, per_token)
            cache[key] = self.agent.agent.prep_xfer_dlist(agent_name, rows, desc.mem_type)
        return cache[key]

    def _unload(self, peer: HeadPeer) -> None:
        peer.live = False
        for dlist in peer.dlists.values():
            dlist.release()
        self.agent.agent.remove_remote_agent(peer.name)

    # -- bookkeeping --------------------------------------------------------------------------

    def _forget(self, endpoint: str, peer: HeadPeer | None = None) -> None:
        """Unload the peer of `endpoint` (only if it is still `peer`, when given)."""
        entry = self.peers.get(endpoint)
        if entry is not None and (peer is None or entry[0] is peer):
            del self.peers[endpoint]
            self._thread.submit(self._unload, entry[0])

    def _touch(self, endpoint: str, peer: HeadPeer) -> None:
        entry = self.peers.get(endpoint)
        if entry is not None and entry[0] is peer:
            self.peers[endpoint] = (peer, time.monotonic())

    def _evict_idle(self) -> None:
        horizon = time.monotonic() - self.idle_s
        for endpoint in [e for e, (_, used) in self.peers.items() if used < horizon]:
            self._forget(endpoint)

    async def _run(self, fn, *args):
        return await asyncio.wrap_future(self._thread.submit(fn, *args))

    async def close(self) -> None:
        for endpoint in list(self.peers):
            self._forget(endpoint)
        await self._run(self._close_agent)
        self._thread.shutdown(wait=True)

    def _close_agent(self) -> None:
        for dlist in self.local.values():
            dlist.release()
        self.local.clear()
        if self.agent is not None:
            self.agent.close()


class _Dropped(Exception):
    """The peer a READ was about to use was unloaded meanwhile: take the current one."""


class _UseGrpc(Exception):
    """This run's server is unreachable over NIXL: fetch it over gRPC."""
