"""`KVHandle`: a claim on one prompt's KV cache, held under a lease on a prefill worker.

Produced by the prefill worker when it grants the lease, carried by the router, presented by the
decode worker to fetch the blocks and then to release them. Valid until the lease is released
or `lease_expiry_unix` (prefill worker's clock) passes; after that a fetch fails and never reads
the blocks, which may already belong to another request. Crosses process boundaries as the
`pdserve.v1.KVHandle` protobuf message; `from_proto` rejects anything malformed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cluster.engine.kv_cache import KVLayout
from cluster.errors import InvalidArgument
from cluster.kv_transfer import registry
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb

_U32 = 1 << 32
MAX_TP_SIZE = 64


@dataclass(frozen=True)
class KVHandle:
    request_id: str
    num_tokens: int
    endpoint: str  # "host:port" of the prefill worker's KV server
    transport: str  # a registered transport (`registry.names()`)
    block_ids: tuple[int, ...]  # in token order; ceil(num_tokens / block_size) of them
    block_size: int
    layout: KVLayout
    lease_expiry_unix: float
    capability_token: bytes
    first_token_id: int | None = None
    # The KV servers of the prefill replica's ranks 1.. at TP > 1 (rank 0's is `endpoint`).
    rank_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidArgument("KV handle has no request_id", param="request_id")
        if not _uint(self.num_tokens, _U32) or self.num_tokens == 0:
            raise InvalidArgument(f"KV handle num_tokens must be positive: {self.num_tokens!r}")
        split_endpoint(self.endpoint)
        if self.transport not in registry.names():
            raise InvalidArgument(f"KV handle transport must be one of {registry.names()}")
        _check_layout(self.layout)
        if self.block_size != self.layout.block_size:
            raise InvalidArgument(
                f"KV handle block_size {self.block_size!r} != layout {self.layout.block_size}"
            )
        if not isinstance(self.block_ids, tuple) or not all(_uint(b, _U32) for b in self.block_ids):
            raise InvalidArgument("KV handle block_ids must be a tuple of uint32")
        expected = -(-self.num_tokens // self.block_size)
        if len(self.block_ids) != expected:
            raise InvalidArgument(
                f"KV handle has {len(self.block_ids)} block ids; {self.num_tokens} tokens "
                f"of block size {self.block_size} need {expected}"
            )
        if len(set(self.block_ids)) != len(self.block_ids):
            raise InvalidArgument("KV handle block_ids repeat a block")
        expiry = self.lease_expiry_unix
        if isinstance(expiry, bool) or not isinstance(expiry, (int, float)):
            raise InvalidArgument("KV handle lease_expiry_unix must be a number")
        if not math.isfinite(expiry):
            raise InvalidArgument("KV handle lease_expiry_unix must be finite")
        if not isinstance(self.capability_token, bytes) or not self.capability_token:
            raise InvalidArgument("KV handle has no capability token")
        if self.first_token_id is not None and not _uint(self.first_token_id, _U32):
            raise InvalidArgument(f"KV handle first_token_id out of range: {self.first_token_id}")
        ranks = self.rank_endpoints
        if not isinstance(ranks, tuple) or len(ranks) != self.layout.tp_size - 1:
            raise InvalidArgument(
                f"KV handle of a TP {self.layout.tp_size} pool needs "
                f"{self.layout.tp_size - 1} rank endpoints"
            )
        for endpoint in ranks:
            split_endpoint(endpoint)

    def rank_endpoint(self, rank: int) -> str:
        """The KV server of the prefill replica's rank `rank`."""
        return self.endpoint if rank == 0 else self.rank_endpoints[rank - 1]

    def to_proto(self) -> pb.KVHandle:
        msg = pb.KVHandle(
            request_id=self.request_id,
            num_tokens=self.num_tokens,
            endpoint=self.endpoint,
            transport=self.transport,
            block_ids=self.block_ids,
            block_size=self.block_size,
            layout=layout_to_proto(self.layout),
            lease_expiry_unix=self.lease_expiry_unix,
            capability_token=self.capability_token,
            rank_endpoints=self.rank_endpoints,
        )
        if self.first_token_id is not None:
            msg.first_token_id = self.first_token_id
        return msg

    @classmethod
    def from_proto(cls, msg: pb.KVHandle) -> KVHandle:
        """Raises InvalidArgument for a missing layout or any field out of range."""
        if not msg.HasField("layout"):
            raise InvalidArgument("KV handle has no layout")
        return cls(
            request_id=msg.request_id,
            num_tokens=msg.num_tokens,
            endpoint=msg.endpoint,
            transport=msg.transport,
            block_ids=tuple(msg.block_ids),
            block_size=msg.block_size,
            layout=layout_from_proto(msg.layout),
            lease_expiry_unix=msg.lease_expiry_unix,
            capability_token=msg.capability_token,
            first_token_id=msg.first_token_id if msg.HasField("first_token_id") else None,
            rank_endpoints=tuple(msg.rank_endpoints),
        )


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(**layout.to_dict())


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    layout = KVLayout(
        model_id=msg.model_id,
        dtype=msg.dtype,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        block_size=msg.block_size,
        kv_head_start=msg.kv_head_start,
        total_kv_heads=msg.total_kv_heads,
        tp_size=msg.tp_size,
    )
    _check_layout(layout)
    return layout


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """("host", port) of a "host:port" or "[v6-host]:port" endpoint; InvalidArgument if bad."""
    host, sep, port = endpoint.rpartition(":") if isinstance(endpoint, str) else ("", "", "")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    digits = port.isascii() and port.isdigit() and len(port) <= 5  # not "²" nor "٣"
    if not sep or not host or not digits or not 0 < int(port) < 65536:
        raise InvalidArgument(f"KV endpoint must be host:port, got {endpoint!r}")
    return host, int(port)


def _check_layout(layout: KVLayout) -> None:
    if not isinstance(layout, KVLayout):
        raise InvalidArgument("KV layout is missing")
    if not layout.model_id or not layout.dtype:
        raise InvalidArgument("KV layout needs a model_id and a dtype")
    dims = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
    if not all(_uint(d, _U32) and d > 0 for d in dims):
        raise InvalidArgument(f"KV layout dimensions must be positive: {layout}")
    if not (_uint(layout.kv_head_start, _U32) and layout.head_end <= layout.total_kv_heads):
        raise InvalidArgument(f"KV layout heads out of range: {layout}")
    if not _uint(layout.tp_size, MAX_TP_SIZE + 1) or layout.tp_size == 0:
        raise InvalidArgument(f"KV layout tp_size must be 1 to {MAX_TP_SIZE}: {layout}")


def _uint(x: object, bound: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < bound
