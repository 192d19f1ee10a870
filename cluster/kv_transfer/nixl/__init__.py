"""The `nixl` KV transport, the fast path on CPUs and GPUs: each engine registers its whole KV
pool with a NIXL agent (`NixlPool`); the decode side (`NixlKVClient`) READs a lease's blocks
straight from the prefill pool into its own while the prefill side (`NixlKVSender`) holds the
lease (ConnectNixl once per pair, HoldKV per transfer). Between tensor-parallel groups of
different sizes each rank registers its own pool with its own agent, and each decode rank READs
exactly its heads from the prefill ranks that hold them (`NixlHeads`, head-sliced READs; on a
prefill rank 1.., `RankNixlSender`). `probe` tells transport "auto" whether NIXL works here."""

from __future__ import annotations

from dataclasses import replace

from cluster.errors import InvalidArgument
from cluster.kv_transfer.base import ClientParts, KVClient, KVSender
from cluster.kv_transfer.kv_control import KVControl
from cluster.kv_transfer.lease_pins import SenderParts
from cluster.kv_transfer.nixl.nixl_kv_client import NixlKVClient
from cluster.kv_transfer.nixl.nixl_kv_sender import NixlKVSender
from cluster.kv_transfer.nixl.nixl_pool import probe  # the registry names it
from cluster.kv_transfer.nixl.nixl_rank_sender import RankNixlSender
from cluster.kv_transfer.nixl.nixl_ranks import NixlHeads

__all__ = ["make_client", "make_heads", "make_rank_parts", "make_sender", "probe"]


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


def make_heads(parts: ClientParts, fallback) -> NixlHeads:
    """How a decode replica's rank 0 READs its heads of KV from a prefill replica of another TP
    size (`fallback`: the gRPC head fetches, for peers NIXL cannot reach). Unavailable if NIXL
    is not usable here."""
    t = parts.transfer
    return NixlHeads(
        parts.pool, parts.control, fallback, t.fetch_timeout_seconds, t.channel_idle_seconds
    )


def make_rank_parts(parts: SenderParts, control: KVControl, fallback, idle_s: float):
    """A tensor-parallel rank 1..'s nixl parts (its `RankServer` serves them beside gRPC): the
    sender of its own pool and how it READs its heads on `ImportKV`; `parts` is the rank's
    gRPC sender's (over `LeaderPins`). Unavailable if NIXL is not usable here."""
    sender = RankNixlSender(replace(parts, transport="nixl", channel_idle_s=idle_s))
    try:
        heads = NixlHeads(
            parts.async_engine.kv_pool, control, fallback, parts.channel_timeout_s, idle_s
        )
    except BaseException:
        sender.pool.close()
        raise
    return [sender], heads
