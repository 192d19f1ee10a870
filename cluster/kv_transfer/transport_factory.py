"""`make_kv_client` and `make_senders`: the two ends of the configured transport, built once,
when a worker starts, through the `registry` (which names each transport's package)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from cluster.errors import Unavailable
from cluster.kv_transfer import registry
from cluster.kv_transfer.base import ClientParts, KVClient, KVSender
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.lease_pins import SenderParts

if TYPE_CHECKING:
    import torch

    from cluster.config import TransferConfig
    from cluster.engine.kv_cache import KVCache

log = logging.getLogger("ray.serve." + __name__)


def make_kv_client(
    transfer: TransferConfig, device: torch.device, max_blocks: int, pool: KVCache | None = None
) -> KVClient:
    """The decode worker's client for `transfer.transport`: `device` is the decode engine's,
    `max_blocks` caps what one fetch may allocate, `pool` is the engine's KV pool (a transport
    may write it directly). Where the transport cannot run here (its factory raises
    Unavailable), the baseline's client; it also fetches every handle that names the baseline.
    InvalidArgument for a transport that is not registered."""
    registry.get(transfer.transport)
    control = KVControl(
        transfer.max_chunk_bytes, transfer.fetch_timeout_seconds, transfer.channel_idle_seconds
    )
    parts = ClientParts(transfer, device, max_blocks, pool, control)
    baseline = registry.package(registry.BASELINE).make_client(parts)
    if transfer.transport == registry.BASELINE:
        return baseline
    try:
        return registry.package(transfer.transport).make_client(replace(parts, fallback=baseline))
    except Unavailable as exc:
        log.warning("KV client falls back to %s: %s", registry.BASELINE, exc.message)
        return baseline


def make_decode_client(
    transfer: TransferConfig,
    device: torch.device,
    pool: KVCache,
    ranks: tuple[str, ...] = (),
    replica_secret: bytes = b"",
):
    """A decode replica's client: `make_kv_client`'s for KV laid out as its pool is, and
    head-sliced moves for KV of a prefill pool of another tensor-parallel size, into this rank's
    pool and, through `ImportKV`, into those of its ranks 1.. (`ranks`, their KV servers, which
    take `replica_secret`): the transport's own (`make_heads`: nixl's READs) where it has them
    and can run here, else the baseline's head-sliced fetches."""
    inner = make_kv_client(transfer, device, pool.num_blocks, pool)
    control = KVControl(
        transfer.max_chunk_bytes, transfer.fetch_timeout_seconds, transfer.channel_idle_seconds
    )
    parts = ClientParts(transfer, device, pool.num_blocks, pool, control)
    baseline = registry.package(registry.BASELINE)
    make_heads = None
    if transfer.transport != registry.BASELINE:
        make_heads = getattr(registry.package(transfer.transport), "make_heads", None)

    def own_heads(grpc_heads):
        try:
            return make_heads(parts, grpc_heads)
        except Unavailable as exc:
            log.warning("TP KV moves fall back to %s: %s", registry.BASELINE, exc.message)
            return grpc_heads

    own = own_heads if make_heads is not None else None
    return baseline.make_sharded_client(inner, parts, ranks, replica_secret, own)


def make_rank_service(transfer: TransferConfig, host: str, replica_secret: bytes):
    """What the ranks 1.. of a tensor-parallel replica serve their KV heads with: the baseline's
    rank server, which also serves `transfer.transport`'s rank parts where it has them."""
    return registry.package(registry.BASELINE).make_rank_service(transfer, host, replica_secret)


def make_senders(parts: SenderParts) -> tuple[str, dict[str, KVSender]]:
    """The senders a prefill worker's KV server mounts for `parts.transport`, by transport:
    the baseline's, and the transport's own when it is another; with the transport its handles
    name (the baseline where the transport cannot run here: its factory raised Unavailable).
    InvalidArgument for a transport that is not registered or cannot be served here."""
    registry.get(parts.transport)
    baseline = registry.package(registry.BASELINE).make_sender(parts)
    if parts.transport == registry.BASELINE:
        return registry.BASELINE, {registry.BASELINE: baseline}
    try:
        own = registry.package(parts.transport).make_sender(parts)
    except Unavailable as exc:
        log.warning("KV server falls back to %s: %s", registry.BASELINE, exc.message)
        return registry.BASELINE, {registry.BASELINE: baseline}
    return parts.transport, {registry.BASELINE: baseline, parts.transport: own}
