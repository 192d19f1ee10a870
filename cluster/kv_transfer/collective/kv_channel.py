"""`KVChannel`: one end of a direct KV transport ("gloo" or "nccl") between two workers.

A channel is a two-rank torch.distributed process group built for one (prefill, decode) pair,
never the global default group: the prefill worker is rank `PREFILL_RANK`, the decode worker
`DECODE_RANK`. Both join through a TCPStore the prefill worker hosts, under a key prefix naming
the channel (the prefill side's `KVServer.OpenChannel` negotiates it over gRPC). Under "nccl"
the KV stays on the GPU end to end; "gloo" runs the same code on host memory.

Every collective call of a channel runs on the channel's own worker thread, in submission
order, so transfers on one pair never interleave (nccl matches sends and receives by order,
not by tag) and never block the event loop or the default executor. A transfer is one message:
the keys and values of every layer in one tensor `[2, layers, blocks, block_size, kv_heads,
head_dim]`. Under "nccl" the channel has its own CUDA stream: the sender's gather of the pool's
blocks waits there on an event recorded after the prefill step that wrote them (never on the
default stream), the receiver's receive waits on the work that allocated its buffer, and each
end synchronizes only that stream before the data is used. `join` ends with a one-element
exchange, so the communicator (NCCL's, or gloo's pair) is set up when the channel opens, not on
the first transfer; "gloo" runs all of this through the same code, streams aside.

The owner keeps `busy` above zero while a transfer is in flight (so the idle cache leaves it
alone) and `last_used` fresh. A failed call closes the channel and raises Unavailable; a closed
channel never carries another transfer (open a new one). `close` is idempotent and tears the
group down after whatever call is already running on the worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cluster.errors import InvalidArgument, Unavailable
from cluster.kv_transfer import registry

log = logging.getLogger("ray.serve." + __name__)

PREFILL_RANK, DECODE_RANK = 0, 1
_WARM_UP_TAG = 1 << 30  # above every transfer's tag (`next_tag`)
_ANY_HOST = ("", "0.0.0.0", "::")


def transport_device(transport: str, engine_device: torch.device) -> torch.device:
    """Where a transport's tensors live: host memory for gloo, the engine's GPU for nccl.
    InvalidArgument when this process cannot run `transport` (checked when workers start)."""
    if transport == "gloo":
        if not dist.is_available() or not dist.is_gloo_available():
            raise InvalidArgument("transport 'gloo' needs torch.distributed with Gloo")
        return torch.device("cpu")
    if transport == "nccl":
        device = torch.device(engine_device)
        if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
            raise InvalidArgument("transport 'nccl' needs CUDA and a torch build with NCCL")
        if device.type != "cuda":
            raise InvalidArgument(
                f"transport 'nccl' needs the model on a CUDA device, not {device}"
            )
        return device
    raise InvalidArgument(f"no direct KV transport {transport!r}; one of {direct_transports()}")


def direct_transports() -> tuple[str, ...]:
    """The transports this folder serves (their names are torch.distributed backends)."""
    return registry.served_by(__package__)


def local_address_for(host: str) -> str:
    """This host's address on the route to `host` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return ""


class KVChannel:
    def __init__(
        self,
        channel_id: str,
        transport: str,
        rank: int,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        if transport not in direct_transports() or rank not in (PREFILL_RANK, DECODE_RANK):
            raise InvalidArgument(f"bad KV channel: transport {transport!r}, rank {rank}")
        self.id = channel_id
        self.transport = transport
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.busy = 0  # transfers in flight or waiting for this channel; owner-managed
        self.last_used = time.monotonic()
        self.closed = False
        self.lock = asyncio.Lock()  # the decode side holds it across PushKV and its receives
        self.joined: asyncio.Future[bool] | None = None  # the prefill side's background join
        self._next_tag = 0
        self._group: Any = None  # ProcessGroupGloo | ProcessGroupNCCL once joined
        self._store: dist.Store | None = None
        self.stream: torch.cuda.Stream | None = None  # nccl: the channel's own, from `join`
        self._worker = _SerialWorker(f"pdserve-kv-{transport}-{channel_id[:8]}")

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def next_tag(self) -> int:
        """The tag of the next transfer (sender side); even, below 2^30."""
        tag = self._next_tag
        self._next_tag = (self._next_tag + 2) % (1 << 30)
        return tag

    async def join(self, store: Callable[[], dist.Store], local_host: str) -> None:
        """Join the group and set up its communicator: blocks (off the loop) until the peer
        has joined too, or the timeout. `store()` is called on the worker thread and must
        return the channel's store."""
        await self._call(self._join, store, local_host)

    async def send(
        self, gather: Callable[[], torch.Tensor], tag: int, ready: torch.cuda.Event | None
    ) -> None:
        """Send `gather()` (keys and values in one tensor, on `device`) to the peer; `gather`
        runs on the channel's stream after `ready` (recorded where the KV was written)."""
        await self._call(self._send, gather, tag, ready)

    async def recv(self, kv: torch.Tensor, tag: int) -> None:
        """Fill `kv` (allocated by the caller, on `device`) from the peer."""
        await self._call(self._recv, kv, tag)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._worker.submit(self._teardown)
        self._worker.stop()

    # -- on the worker thread --------------------------------------------------------------

    async def _call(self, fn: Callable[..., None], *args: Any) -> None:
        if self.closed:
            raise Unavailable(f"KV channel {self.id} is closed")
        self.touch()
        try:
            await asyncio.wrap_future(self._worker.submit(fn, *args))
        except asyncio.CancelledError:  # the peer may be mid-transfer: the pair is out of step
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise Unavailable(f"KV channel {self.id} ({self.transport}) broke: {exc}") from None
        finally:
            self.touch()

    def _join(self, store: Callable[[], dist.Store], local_host: str) -> None:
        self._store = store()
        if self.transport == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [_gloo_device(local_host)]
            self._group = dist.ProcessGroupGloo(self._store, self.rank, 2, options)
        else:
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._group = dist.ProcessGroupNCCL(self._store, self.rank, 2, options)
            self.stream = torch.cuda.Stream(self.device)
        # One element each way now: the communicator is made here, not on the first transfer.
        probe = torch.zeros(1, device=self.device)
        if self.rank == PREFILL_RANK:
            self._send(lambda: probe, _WARM_UP_TAG, None)
        else:
            self._recv(probe, _WARM_UP_TAG)

    def _send(
        self, gather: Callable[[], torch.Tensor], tag: int, ready: torch.cuda.Event | None
    ) -> None:
        with self._on_stream():
            if ready is not None and self.stream is not None:
                self.stream.wait_event(ready)
            kv = gather()  # kept alive until the send is complete
            self._group.send([kv], self.peer, tag).wait(self.timeout)
        self._settle()

    def _recv(self, kv: torch.Tensor, tag: int) -> None:
        if self.stream is not None:  # after the work that allocated (and last used) `kv`
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_stream():
            self._group.recv([kv], self.peer, tag).wait(self.timeout)
        self._settle()

    def _on_stream(self) -> contextlib.AbstractContextManager:
        if self._group is None:
            raise RuntimeError("the channel's group is not joined")
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def _settle(self) -> None:
        """The transfer is complete on this end before anyone uses (or frees) its tensor."""
        if self.stream is not None:
            self.stream.synchronize()

    def _teardown(self) -> None:
        group, self._group, self._store = self._group, None, None
        if group is not None:
            try:
                group.shutdown()
            except Exception as exc:  # already broken: nothing left to free
                log.debug("KV channel %s teardown: %s", self.id, exc)


def _gloo_device(local_host: str):
    if local_host in _ANY_HOST:
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=local_host)


class _SerialWorker:
    """One daemon thread running submitted calls in order (daemon: a call stuck until its
    timeout never holds up interpreter exit)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, future))
        return future

    def stop(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)
