"""The KV server of a tensor-parallel replica's rank 1.. (`RankService`), in that rank's
process, on the node's address: how its own heads of the replica's KV leave it and arrive in it
without passing through rank 0.

- **Prefill rank** (`FetchKV`): the `grpc` transport's sender over this rank's pool. A read
  presents the handle rank 0 issued; its token is checked here, and the lease is pinned on rank
  0, which owns every lease, through `PinKV` for as long as the read lasts (`LeaderPins`), so
  the blocks cannot be freed or reused meanwhile. A `receiver_layout` may name a head slice of
  this rank's heads (a decode rank of another TP size).
- **Decode rank** (`ImportKV`): rank 0 asks, with the secret it gave this rank when it started
  it, for this rank's heads of a handle written into blocks it reserved; this rank fetches them
  from the prefill ranks that hold them (`tp_ranks.fetch_heads`) and answers once nothing
  writes those blocks any more. The block ids are checked against the pool and the handle
  before anything moves.

With the app's transport nixl, the rank serves nixl's rank parts beside these
(`nixl.nixl_ranks`): ConnectNixl/HoldKV over its own NIXL agent and pool, and `ImportKV` by
head-sliced NIXL READs.

The server runs an event loop of its own on a daemon thread beside the rank's step loop; its
reads and writes touch only blocks the leases and reservations keep out of the steps' way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from cluster.engine.kv_cache import KVCache
from cluster.errors import (
    InvalidArgument,
    NotFound,
    PdServeError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from cluster.kv_transfer import registry
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.grpc.grpc_kv_sender import GrpcKVSender
from cluster.kv_transfer.grpc.tp_ranks import GrpcHeads
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.kv_server_stubs import KVServerStubs
from cluster.kv_transfer.kv_wire import HEADER_SLACK, MAX_REQUEST_BYTES
from cluster.kv_transfer.lease_pins import SERVICE, SenderParts, abort, generated_handlers
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.pb.pdserve.v1.kv_transfer_pb2_grpc import KVTransferServicer

log = logging.getLogger("ray.serve." + __name__)


@dataclass(frozen=True)
class RankService:
    """What a rank's KV server is built from (picklable: it crosses to the rank's process):
    the node's `host` to bind, the cluster's capability `secret` (hex), the `replica_secret`
    rank 0 calls `ImportKV` with, the transfer's chunk limit and deadline, the app's
    `transport` (one with rank parts, nixl, is served beside gRPC) and how long that
    transport keeps an unused peer (`idle_s`)."""

    host: str
    secret: str
    replica_secret: bytes
    max_chunk_bytes: int
    timeout_s: float
    transport: str = registry.BASELINE
    idle_s: float = 60.0

    def start(self, pool: KVCache, leader: Callable[[], str]) -> str:
        """Serve on a daemon thread; returns the bound "host:port". `leader()`: rank 0's KV
        server (blocks until rank 0 has one)."""
        started = threading.Event()
        result: dict = {}

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            server = RankServer(self, pool, leader)
            try:
                result["endpoint"] = loop.run_until_complete(server.start())
            except BaseException as exc:
                result["error"] = exc
                started.set()
                return
            started.set()
            loop.run_forever()

        threading.Thread(target=run, name="pdserve-rank-kv", daemon=True).start()
        started.wait()
        if "error" in result:
            raise result["error"]
        return result["endpoint"]


class LeaderPins:
    """`LeasePins` for a rank's sender: each pin is a `PinKV` call to rank 0 held open until
    `end_fetch`. Rank 0's endpoint is looked up once (`leader()` blocks until rank 0 published
    it; it never changes while this rank lives)."""

    def __init__(self, capability: Capability, stubs: KVServerStubs, leader, timeout_s: float):
        self.capability = capability
        self.stubs = stubs
        self.leader = leader
        self.timeout_s = timeout_s
        self.endpoint: str | None = None
        self._calls: dict[str, list] = {}

    async def begin_fetch(self, request_id: str, token: bytes) -> tuple[list[int], int]:
        if self.endpoint is None:
            self.endpoint = await asyncio.to_thread(self.leader)
        endpoint = self.endpoint
        request = pb.PinKVRequest(request_id=request_id, capability_token=token)
        call = self.stubs.stub(endpoint).PinKV(request, timeout=self.timeout_s)
        try:
            pinned = await call.read()
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"lease {request_id!r}: {exc.details()}") from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise Unauthenticated(exc.details() or "bad capability token") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhausted(f"PinKV on {endpoint}: {exc.details()}") from None
            raise Unavailable(f"PinKV on {endpoint}: {code.name} {exc.details()}") from None
        if pinned is grpc.aio.EOF:
            raise Unavailable(f"PinKV on {endpoint} ended without pinning")
        self._calls.setdefault(request_id, []).append(call)
        return list(pinned.block_ids), pinned.num_tokens

    def end_fetch(self, request_id: str) -> None:
        calls = self._calls.get(request_id)
        if calls:
            calls.pop().cancel()
            if not calls:
                del self._calls[request_id]

    def on_end(self, listener) -> None:
        pass  # nothing here outlives one read


class _Pool:
    """`AsyncEngine.read_held_kv` and `kv_pool` for a rank without an engine: the pin on rank 0
    (checked against the handle's blocks by `pin_slice`) is what makes the read safe."""

    def __init__(self, pool: KVCache) -> None:
        self.pool = pool
        self.kv_pool = pool

    def read_held_kv(self, request_id: str, block_ids: list[int], read):
        return read(self.pool)


class RankServer(KVTransferServicer):
    """The rank's KV server: the gRPC sender's `FetchKV` and `ImportKV`, whose heads move
    through `heads` (`GrpcHeads`; a transport's rank server sets its own), plus the handlers
    of `senders` (a transport's own, built by a subclass from `parts`)."""

    def __init__(self, service: RankService, pool: KVCache, leader) -> None:
        self.service = service
        self.pool = pool
        self.control = KVControl(service.max_chunk_bytes, service.timeout_s)
        self.stubs = self.control.stubs
        capability = Capability(bytes.fromhex(service.secret))
        self.pins = LeaderPins(capability, self.stubs, leader, service.timeout_s)
        self.parts = SenderParts(
            _Pool(pool),
            self.pins,
            pool.layout,
            service.host,
            "grpc",
            service.max_chunk_bytes,
            channel_timeout_s=service.timeout_s,
        )
        self.senders: list = [GrpcKVSender(self.parts)]
        self.client = GrpcKVClient(
            service.max_chunk_bytes,
            service.timeout_s,
            max_blocks=pool.num_blocks,
            control=self.control,
        )
        self.heads = GrpcHeads(self.client)
        if service.transport != registry.BASELINE:
            self._add_transport(service.transport)
        self._server: grpc.aio.Server | None = None

    def _add_transport(self, name: str) -> None:
        """Serve `name`'s rank parts too (its senders; its way of moving this rank's heads,
        with gRPC as its fallback), where its package has them and they can run here."""
        make = getattr(registry.package(name), "make_rank_parts", None)
        if make is None:
            return
        try:
            senders, self.heads = make(self.parts, self.control, self.heads, self.service.idle_s)
        except Unavailable as exc:
            log.warning("rank KV server serves %s only: %s", registry.BASELINE, exc.message)
            return
        self.senders += senders

    async def start(self) -> str:
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", self.service.max_chunk_bytes + HEADER_SLACK),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
            ]
        )
        handlers = generated_handlers(self, ("ImportKV",))
        for sender in self.senders:
            handlers.update(sender.handlers()[SERVICE])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)
        host = self.service.host
        host = f"[{host}]" if ":" in host else host
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        self._server = server
        for sender in self.senders:
            await sender.start()
        return f"{host}:{port}"

    async def ImportKV(
        self, request: pb.ImportKVRequest, context: grpc.aio.ServicerContext
    ) -> pb.ImportKVResponse:
        try:
            if not hmac.compare_digest(request.replica_secret, self.service.replica_secret):
                raise Unauthenticated("ImportKV is for this replica's rank 0 only")
            if not request.HasField("handle"):
                raise InvalidArgument("ImportKV needs a handle")
            handle = KVHandle.from_proto(request.handle)
            block_ids = list(request.block_ids)
            if len(block_ids) != len(handle.block_ids) or len(set(block_ids)) != len(block_ids):
                raise InvalidArgument("ImportKV block_ids do not match the handle")
            if any(b >= self.pool.num_blocks for b in block_ids):
                raise InvalidArgument(f"ImportKV block ids beyond {self.pool.num_blocks} blocks")
            nbytes, nixl_bytes = await self.heads.fetch_heads(handle, self.pool, block_ids)
        except PdServeError as exc:
            await abort(context, exc)
        return pb.ImportKVResponse(nbytes=nbytes, nixl_bytes=nixl_bytes)
