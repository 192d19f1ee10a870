"""`KVChannel`: one end of a direct KV transport ("gloo" or "nccl") between two workers.

A channel is a two-rank torch.distributed process group built for one (prefill, decode) pair,
never the global default group: the prefill worker is rank `PREFILL_RANK`, the decode worker
`DECODE_RANK`. Both join through a TCPStore the prefill worker hosts, under a key prefix naming
the channel (the prefill side's `KVServer.OpenChannel` negotiates it over gRPC). Under "nccl"
the KV stays on the GPU end to end; "gloo" runs the same code on host memory.

Every collective call of a channel runs on the channel's own worker thread, in submission
order, so transfers on one pair never interleave (nccl matches sends and receives by order,
not by tag) and never block the event loop or the default executor. The owner keeps `busy`
above zero while a transfer is in flight (so the idle cache leaves it alone) and `last_used`
fresh. A failed call closes the channel and raises Unavailable; a closed channel never carries
another transfer (open a new one). `close` is idempotent and tears the group down after
whatever call is already running on the worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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

log = logging.getLogger(__name__)

DIRECT_TRANSPORTS = ("gloo", "nccl")
PREFILL_RANK, DECODE_RANK = 0, 1
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
    raise InvalidArgument(f"no direct KV transport {transport!r}; one of {DIRECT_TRANSPORTS}")


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
        if transport not in DIRECT_TRANSPORTS or rank not in (PREFILL_RANK, DECODE_RANK):
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
        self._worker = _SerialWorker(f"pdserve-kv-{transport}-{channel_id[:8]}")

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def next_tag(self) -> int:
        """Tags of the next transfer's keys; values use tag + 1 (sender side)."""
        tag = self._next_tag
        self._next_tag = (self._next_tag + 2) % (1 << 30)
        return tag

    async def join(self, store: Callable[[], dist.Store], local_host: str) -> None:
        """Join the group: blocks (off the loop) until the peer joins too, or the timeout.
        `store()` is called on the worker thread and must return the channel's store."""
        await self._call(self._join, store, local_host)

    async def send(self, k: torch.Tensor, v: torch.Tensor, tag: int) -> None:
        """Send keys (tag) then values (tag + 1) to the peer; returns once both are out."""
        await self._call(self._transfer, "send", k, v, tag)

    async def recv(self, k: torch.Tensor, v: torch.Tensor, tag: int) -> None:
        """Fill `k` and `v` (allocated by the caller, on `device`) from the peer."""
        await self._call(self._transfer, "recv", k, v, tag)

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
        else:  # nccl: its communicator is created on the first send / recv, on this device
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._group = dist.ProcessGroupNCCL(self._store, self.rank, 2, options)

    def _transfer(self, op: str, k: torch.Tensor, v: torch.Tensor, tag: int) -> None:
        if self._group is None:
            raise RuntimeError("the channel's group is not joined")
        call = self._group.send if op == "send" else self._group.recv
        works = [call([k], self.peer, tag), call([v], self.peer, tag + 1)]
        for work in works:
            work.wait(self.timeout)
        if k.is_cuda:  # the peer's data (or our send) is complete before anyone reads on
            torch.cuda.current_stream(k.device).synchronize()

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
