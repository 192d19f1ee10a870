"""`NixlPool`: one engine's NIXL agent (UCX backend), the KV memory it registered (its paged
pool) and the peers (other engines' pools) it can READ from.

Both ends of the `nixl` transport make one when their worker starts and `register` their pool
with it (a `Region`). The prefill side describes its pool (`describe`, a `NixlPool` message: the
agent's metadata in NIXL's own format plus the pool's base addresses and strides); the decode
side registers its own, and on the first transfer from a prefill replica turns that
description into a `Peer` (`add_peer`): every field is checked against the reader's own layout
first, and the descriptors are built here from the checked numbers (NIXL's pickled descriptor
lists never cross the wire). Descriptors are prepared once per region and per peer, one per
(K or V, layer, block); a transfer selects them by index, and NIXL merges runs of blocks that
are contiguous on both sides into one descriptor (a fresh pool hands out contiguous blocks, so
a prompt is typically one descriptor per layer for K and one for V).

Host memory registers as "DRAM", GPU memory as "VRAM" (UCX then moves it with CUDA IPC or
NVLink between GPUs of one node, RDMA between nodes). The agent runs without NIXL's progress
thread, which spins a core whole: the reader progresses by polling its transfer, the target by
`progress()` while it holds a lease for a reader (UCX's wire-up and its TCP transport need the
target to progress; shared memory does not).

Not thread-safe: the owner calls one method at a time (the decode side from one worker thread).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cluster.engine.kv_cache import KVLayout
from cluster.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PdServeError,
    Unavailable,
)
from cluster.kv_transfer.kv_wire import DTYPES
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

MEM_TYPES = ("DRAM", "VRAM")
MAX_METADATA_BYTES = 1 << 20  # an agent's metadata is a few KiB
MAX_POOL_BLOCKS = 1 << 24
_LOCAL = "NIXL_INIT_AGENT"

log = logging.getLogger("ray.serve." + __name__)


def load_nixl() -> Any:
    """NIXL's Python API (`nixl_cu12._api`); Unavailable if the package does not import."""
    try:
        with _handlers_kept_open():
            from nixl_cu12 import _api
    except Exception as exc:  # ImportError, or a native library that fails to load
        raise Unavailable(f"NIXL is not usable here: {exc}") from None
    return _api


@contextlib.contextmanager
def _handlers_kept_open() -> Iterator[None]:
    """On its first import NIXL sets up its "nixl" logger with `logging.config.dictConfig`,
    which also closes every logging handler the process has: in a Serve replica, the one that
    writes the replica's log file, which then stays silent. Hidden from it, they stay open."""
    live = logging._handlerList[:]  # weak references to every handler made so far
    del logging._handlerList[:]
    try:
        yield
    finally:
        logging._handlerList[:0] = live


@dataclass
class Peer:
    """A remote pool this agent may READ from: its agent's name and prepared descriptors."""

    name: str
    num_blocks: int
    dlist: Any  # nixl_prepped_dlist_handle over the remote pool


class Region:
    """KV tensors registered with a `NixlPool`'s agent, with their prepared descriptors."""

    def __init__(self, agent: Any, k: torch.Tensor, v: torch.Tensor, layout: KVLayout) -> None:
        _check_pool_tensors(k, v, layout)
        self.num_layers = layout.num_layers
        self.num_blocks = k.shape[1]
        self.mem_type = "VRAM" if k.is_cuda else "DRAM"
        self.device_id = k.get_device() if k.is_cuda else 0
        item = k.element_size()
        self.bases = (k.data_ptr(), v.data_ptr())
        self.strides = (k.stride(0) * item, k.stride(1) * item, k[0, 0].numel() * item)
        self._agent = agent
        self._tensors = (k, v)  # kept alive while registered
        self._registered = agent.register_memory([k, v])
        rows = pool_rows(self.bases, self.num_layers, self.strides, self.num_blocks, self.device_id)
        self.dlist = agent.prep_xfer_dlist(_LOCAL, rows, self.mem_type)

    @property
    def block_bytes(self) -> int:
        return self.strides[2]

    def release(self) -> None:
        self.dlist.release()
        self._agent.deregister_memory(self._registered)


class NixlPool:
    def __init__(self, layout: KVLayout, role: str, telemetry: bool = False) -> None:
        """A new agent (named after `role`) for KV of `layout`; `register` gives it memory.
        With `telemetry`, `read` returns the descriptors NIXL posted after merging.
        Unavailable if NIXL is not usable here."""
        api = load_nixl()
        self.layout = layout
        config = api.nixl_agent_config(
            enable_prog_thread=False, capture_telemetry=telemetry, backends=["UCX"]
        )
        try:
            self.agent = api.nixl_agent(f"pdserve-{role}-{secrets.token_hex(8)}", config)
        except Exception as exc:
            raise Unavailable(f"NIXL agent not created: {exc}") from None
        if "UCX" not in self.agent.backends:
            raise Unavailable("NIXL has no UCX backend here")
        self.telemetry = telemetry
        self.regions: list[Region] = []
        self.peers: dict[str, Peer] = {}

    @property
    def name(self) -> str:
        return self.agent.name

    def register(self, k: torch.Tensor, v: torch.Tensor) -> Region:
        """Register `k` and `v` (`[num_layers, num_blocks, block_size, kv_heads, head_dim]`,
        contiguous, on one device): host memory as DRAM, GPU memory as VRAM."""
        region = Region(self.agent, k, v, self.layout)
        self.regions.append(region)
        return region

    def unregister(self, region: Region) -> None:
        self.regions.remove(region)
        region.release()

    def describe(self, region: Region) -> pb.NixlPool:
        """The agent and `region`, as a reader needs them (`add_peer` on its side)."""
        layer_stride, block_stride, block_bytes = region.strides
        return pb.NixlPool(
            agent_name=self.name,
            agent_metadata=self.agent.get_agent_metadata(),
            mem_type=region.mem_type,
            device_id=region.device_id,
            k_base=region.bases[0],
            v_base=region.bases[1],
            layer_stride=layer_stride,
            block_stride=block_stride,
            block_bytes=block_bytes,
            num_layers=region.num_layers,
            num_blocks=region.num_blocks,
        )

    def add_peer(self, desc: pb.NixlPool) -> Peer:
        """Load a remote pool's description, checked against our layout: FailedPrecondition if
        its geometry differs, InvalidArgument if it is malformed, Unavailable if NIXL refuses
        it (metadata it cannot parse, memory it cannot reach)."""
        check_description(desc, self.layout)
        if desc.agent_name in self.peers:
            self.remove_peer(desc.agent_name)
        try:
            name = self.agent.add_remote_agent(desc.agent_metadata)
        except Exception as exc:
            raise Unavailable(f"NIXL cannot load agent {desc.agent_name}: {exc}") from None
        name = name.decode() if isinstance(name, bytes) else name
        if name != desc.agent_name:
            self.agent.remove_remote_agent(name)
            raise InvalidArgument(f"NIXL metadata names agent {name!r}, not {desc.agent_name!r}")
        try:
            strides = (desc.layer_stride, desc.block_stride, desc.block_bytes)
            bases = (desc.k_base, desc.v_base)
            rows = pool_rows(bases, desc.num_layers, strides, desc.num_blocks, desc.device_id)
            dlist = self.agent.prep_xfer_dlist(name, rows, desc.mem_type)
            self.agent.make_connection(name)
        except Exception as exc:  # NIXL refuses descriptors outside the peer's registrations
            self.agent.remove_remote_agent(name)
            raise Unavailable(f"NIXL peer {name} refused: {exc}") from None
        peer = Peer(name, desc.num_blocks, dlist)
        self.peers[name] = peer
        return peer

    def remove_peer(self, name: str) -> None:
        peer = self.peers.pop(name, None)
        if peer is not None:
            peer.dlist.release()
            self.agent.remove_remote_agent(name)

    def read(
        self,
        peer: Peer,
        region: Region,
        local_blocks: list[int],
        remote_blocks: list[int],
        timeout_s: float,
    ) -> int:
        """READ the K and V of every layer of `remote_blocks` of `peer` into `local_blocks` of
        `region` (pairwise); returns the descriptors NIXL posted (after merging; without
        telemetry, the descriptors selected). Blocks until the READ is complete;
        DeadlineExceeded after `timeout_s` (the transfer is then cancelled)."""
        if len(local_blocks) != len(remote_blocks) or not local_blocks:
            raise InvalidArgument("a NIXL read needs as many local as remote blocks, >= 1")
        for blocks, n in ((local_blocks, region.num_blocks), (remote_blocks, peer.num_blocks)):
            if not all(0 <= b < n for b in blocks):
                raise InvalidArgument(f"block ids out of range for a pool of {n} blocks")
        local = self.block_indices(local_blocks, region.num_blocks)
        remote = self.block_indices(remote_blocks, peer.num_blocks)
        try:
            handle = self.agent.make_prepped_xfer("READ", region.dlist, local, peer.dlist, remote)
        except Exception as exc:  # NIXL's own errors: the peer is gone or refuses
            raise Unavailable(f"NIXL read from {peer.name} not posted: {exc!r}") from None
        try:
            self.wait(handle, peer.name, timeout_s)
            if not self.telemetry:
                return len(local)
            return int(self.agent.get_xfer_telemetry(handle).descCount)
        finally:
            try:
                handle.release()
            except Exception as exc:  # a transfer to a dead peer may refuse its release
                log.warning("NIXL transfer handle not released: %r", exc)

    def wait(self, handle: Any, peer_name: str, timeout_s: float) -> None:
        """Post the READ and wait for it. A peer that died mid-way makes NIXL raise its own
        error (nixlRemoteDisconnectError): Unavailable, so the request is prefilled again."""
        deadline = time.monotonic() + timeout_s
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(f"NIXL read from {peer_name} timed out")
                time.sleep(20e-6)
                state = self.agent.check_xfer_state(handle)
        except PdServeError:
            raise
        except Exception as exc:
            raise Unavailable(f"NIXL read from {peer_name} failed: {exc!r}") from None
        if state != "DONE":
            raise Unavailable(f"NIXL read from {peer_name} failed ({state})")

    def block_indices(self, blocks: list[int], num_blocks: int) -> np.ndarray:
        """Indexes into a prepared list (rows K layer 0..L-1, then V; `num_blocks` per row) of
        every (K or V, layer) of `blocks`, in that order: `[2 * num_layers * len(blocks)]`."""
        rows = np.arange(2 * self.layout.num_layers, dtype=np.int64)[:, None] * num_blocks
        return (rows + np.asarray(blocks, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)

    def progress(self) -> None:
        """Let UCX make progress for remote readers (their wire-up; TCP transfers)."""
        self.agent.get_new_notifs()

    def close(self) -> None:
        for name in list(self.peers):
            self.remove_peer(name)
        for region in list(self.regions):
            self.unregister(region)


def pool_rows(
    bases: tuple[int, int],
    num_layers: int,
    strides: tuple[int, int, int],
    num_blocks: int,
    device_id: int,
) -> np.ndarray:
    """A pool as strided descriptor rows (address, length, device, stride, count): one row per
    (K or V, layer), `num_blocks` blocks of `block_bytes` each `block_stride` apart, from
    `strides` = (layer_stride, block_stride, block_bytes)."""
    layer_stride, block_stride, block_bytes = strides
    layers = np.arange(num_layers, dtype=np.uint64) * np.uint64(layer_stride)
    rows = np.zeros((2 * num_layers, 5), dtype=np.uint64)
    rows[:, 0] = np.concatenate([np.uint64(bases[0]) + layers, np.uint64(bases[1]) + layers])
    rows[:, 1] = block_bytes
    rows[:, 2] = device_id
    rows[:, 3] = block_stride
    rows[:, 4] = num_blocks
    return rows


def check_description(desc: pb.NixlPool, layout: KVLayout) -> None:
    """FailedPrecondition if a peer's pool cannot hold KV of `layout` block for block;
    InvalidArgument if the description is malformed (sizes, addresses out of range)."""
    if not desc.agent_name or len(desc.agent_name) > 256:
        raise InvalidArgument("NIXL pool has no agent name, or one over 256 characters")
    if not 0 < len(desc.agent_metadata) <= MAX_METADATA_BYTES:
        raise InvalidArgument("NIXL agent metadata is empty or over 1 MiB")
    if desc.mem_type not in MEM_TYPES:
        raise InvalidArgument(f"NIXL pool mem_type {desc.mem_type!r} is not one of {MEM_TYPES}")
    if desc.mem_type == "DRAM" and desc.device_id != 0:
        raise InvalidArgument("a DRAM pool has device_id 0")
    if desc.num_layers != layout.num_layers:
        raise FailedPrecondition(
            f"NIXL pool has {desc.num_layers} layers; this layout has {layout.num_layers}"
        )
    block_bytes = DTYPES[layout.dtype].itemsize
    for d in layout.block_shape:
        block_bytes *= d
    if desc.block_bytes != block_bytes:
        raise FailedPrecondition(
            f"NIXL pool blocks are {desc.block_bytes} bytes; this layout's are {block_bytes}"
        )
    if not 0 < desc.num_blocks <= MAX_POOL_BLOCKS:
        raise InvalidArgument(f"NIXL pool of {desc.num_blocks} blocks")
    if desc.block_stride < block_bytes or desc.layer_stride < desc.num_blocks * desc.block_stride:
        raise InvalidArgument("NIXL pool strides overlap its blocks")
    span = (desc.num_layers - 1) * desc.layer_stride + (desc.num_blocks - 1) * desc.block_stride
    for base in (desc.k_base, desc.v_base):
        if base == 0 or base + span + block_bytes >= 1 << 64:
            raise InvalidArgument("NIXL pool addresses out of range")


def _check_pool_tensors(k: torch.Tensor, v: torch.Tensor, layout: KVLayout) -> None:
    shape = (layout.num_layers, k.shape[1] if k.dim() == 5 else -1, *layout.block_shape)
    if k.dim() != 5 or tuple(k.shape) != shape or k.shape != v.shape:
        raise InvalidArgument(f"KV pool of shape {tuple(k.shape)} is not {shape}")
    if k.dtype != DTYPES.get(layout.dtype) or v.dtype != k.dtype or k.device != v.device:
        raise InvalidArgument("KV pool tensors differ in dtype or device from the layout")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise InvalidArgument("a NIXL-registered KV pool must be contiguous")


def probe(timeout_s: float = 5.0) -> str:
    """ "" if NIXL works here: two agents in this process, one READing a registered tensor of
    the other through UCX; else the reason it does not."""
    layout = KVLayout("nixl-probe", "float32", 1, 1, 4, 1)
    try:
        source, reader = NixlPool(layout, "probe"), NixlPool(layout, "probe")
    except Unavailable as exc:
        return exc.message
    try:
        k = torch.arange(8, dtype=torch.float32).reshape(1, 2, 1, 1, 4)
        got = torch.zeros_like(k)
        peer = reader.add_peer(source.describe(source.register(k, k + 8)))
        region = reader.register(got, torch.zeros_like(got))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            done = pool.submit(reader.read, peer, region, [1], [0], timeout_s)
            while not done.done():  # the source progresses for the reader's wire-up
                source.progress()
                time.sleep(1e-3)
            done.result()
        if not torch.equal(got[0, 1], k[0, 0]):
            return "a NIXL read returned wrong bytes"
        return ""
    except Exception as exc:  # any failure means: not here
        return f"NIXL read failed: {exc}"
    finally:
        reader.close()
        source.close()
