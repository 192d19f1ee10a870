"""The `nixl` KV transport, the fast path on CPUs and GPUs: each engine registers its whole KV
pool with a NIXL agent (`NixlPool`); the decode side (`NixlKVClient`) READs a lease's blocks
straight from the prefill pool into its own while the prefill side (`NixlKVSender`) holds the
lease (ConnectNixl once per pair, HoldKV per transfer). `probe` tells transport "auto" whether
NIXL works here."""

from __future__ import annotations

from cluster.errors import InvalidArgument
from cluster.kv_transfer.base import ClientParts, KVClient, KVSender
from cluster.kv_transfer.lease_pins import SenderParts
from cluster.kv_transfer.nixl.nixl_kv_client import NixlKVClient
from cluster.kv_transfer.nixl.nixl_kv_sender import NixlKVSender
from cluster.kv_transfer.nixl.nixl_pool import probe  # the registry names it

__all__ = ["make_client", "make_sender", "probe"]


def make_client(parts: ClientParts) -> KVClient:
    """Unavailable if NIXL is not usable here."""
    if parts.fallback is None:
        raise InvalidArgument("the nixl client needs the baseline's client as its fallback")
    return NixlKVClient(
        parts.pool,
        parts.transfer.fetch_timeout_seconds,
        control=parts.control,
        fallback=parts.fallback,
        max_blocks=parts.max_blocks,
        idle_seconds=parts.transfer.channel_idle_seconds,
    )


def make_sender(parts: SenderParts) -> KVSender:
    """Unavailable if NIXL is not usable here."""
    return NixlKVSender(parts)
