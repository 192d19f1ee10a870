"""The one communication seam between the ranks of a tensor-parallel replica.

`TPGroup` is all the model and the engine may ask of their peers: their rank and the world size,
an in-place sum over ranks (`all_reduce`, after each row-parallel layer), the shards of every
rank side by side (`all_gather`, the vocabulary-parallel LM head's logits) and rank 0's value of
a small message (`broadcast_object`, the step's batch). Two implementations:

- `SINGLE` (TP 1): rank 0 of 1; every call returns its input. The TP 1 path never runs a
  collective, nor builds one.
- `TorchGroup`: torch.distributed process groups made from a `TCPStore` rendezvous, without the
  default (global) group, so several groups can live in one process. Tensors go through NCCL
  on a GPU and gloo on the CPU; messages always through gloo, on the host (as vLLM keeps its
  metadata off the NCCL group). Every collective carries the group's timeout (`timeout_s`):
  a peer that died or hangs fails the step instead of hanging it. The one exception is a
  follower's wait for the next step (`broadcast_object(..., timeout_s=None)`): an idle replica
  sends no step for as long as it is idle, so that wait has no deadline; a leader that dies
  closes its sockets and gloo fails the wait.

Messages are msgpack (plain lists, ints, bytes, str): never pickle, even between our own ranks.
A message is refused above `max_message_bytes`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import msgpack
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from cluster.errors import PdServeError

MAX_MESSAGE_BYTES = 64 << 20
HEAD_BYTES = 4096
# A follower waiting for the next step: no deadline (see the module docstring).
FOREVER = timedelta(days=365)


class TPGroup(Protocol):
    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape on all), concatenated along the last dim in rank order."""
        ...

    def broadcast_object(self, obj: Any = None, timeout_s: float | None = -1.0) -> Any:
        """Rank 0's `obj` (msgpack types) on every rank; the others pass None. `timeout_s`: the
        group's when negative, none when None."""
        ...


class SingleRank:
    """TP 1: no peers, no collectives."""

    rank = 0
    world_size = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast_object(self, obj: Any = None, timeout_s: float | None = -1.0) -> Any:
        return obj


SINGLE = SingleRank()


def host_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on `host`, on a free port (`store.port`) for the others to
    join with `join_store`."""
    return dist.TCPStore(
        host, 0, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, False, timedelta(seconds=timeout_s))


class TorchGroup:
    """One rank of a tensor-parallel group over torch.distributed (see the module docstring).
    Every rank must make the same calls in the same order, as with any collective."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: dist.Store,
        device: torch.device,
        timeout_s: float,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        connect_timeout_s: float = 300.0,
    ) -> None:
        """Joins the group: blocks until every rank has (`connect_timeout_s`, which covers
        the slowest rank's start). `timeout_s` is each collective's deadline afterwards."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.max_message_bytes = max_message_bytes
        connect = timedelta(seconds=connect_timeout_s)
        self.host = dist.ProcessGroupGloo(dist.PrefixStore("host", store), rank, world_size,
                                          connect)  # fmt: skip
        self.tensors = self.host
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout  # NCCL's watchdog enforces it
            self.tensors = dist.ProcessGroupNCCL(
                dist.PrefixStore("tensors", store), rank, world_size, options
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.timeout = self.timeout
        self.tensors.allreduce([x], options).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        options = AllgatherOptions()  # not re-exported by torch.distributed
        options.timeout = self.timeout
        self.tensors.allgather([parts], [x], options).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None, timeout_s: float | None = -1.0) -> Any:
        data = b""
        if self.rank == 0:
            data = msgpack.packb(obj, use_bin_type=True)
            if len(data) > self.max_message_bytes:
                raise PdServeError(f"a {len(data)}-byte message exceeds the group's limit")
        if timeout_s is None:
            first = FOREVER
        else:
            first = self.timeout if timeout_s < 0 else timedelta(seconds=timeout_s)
        # One broadcast of a fixed-size head (the length, then the message's first bytes)
        # carries a whole step of a few dozen sequences; the rest, if any, follows in a second.
        head = torch.zeros(HEAD_BYTES, dtype=torch.uint8)
        if self.rank == 0:
            first_part = len(data).to_bytes(8, "little") + data[: HEAD_BYTES - 8]
            head[: len(first_part)] = torch.frombuffer(bytearray(first_part), dtype=torch.uint8)
        self._broadcast(head, first)
        n = int.from_bytes(head[:8].numpy().tobytes(), "little")
        if not 0 < n <= self.max_message_bytes:
            raise PdServeError(f"rank 0 announced a {n}-byte message")
        rest = b""
        if n > HEAD_BYTES - 8:
            tail = data[HEAD_BYTES - 8 :] if self.rank == 0 else bytes(n - (HEAD_BYTES - 8))
            tail_t = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
            self._broadcast(tail_t, self.timeout)
            rest = tail_t.numpy().tobytes()
        if self.rank == 0:
            return obj
        body = head[8 : 8 + min(n, HEAD_BYTES - 8)].numpy().tobytes() + rest
        return msgpack.unpackb(body, raw=False, strict_map_key=True)

    def _broadcast(self, x: torch.Tensor, timeout: timedelta) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor, options.timeout = 0, 0, timeout
        self.host.broadcast([x], options).wait()
