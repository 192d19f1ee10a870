"""The `gloo` and `nccl` KV transports: a two-rank torch.distributed process group per
(prefill, decode) pair (`KVChannel`, cached while used by `KVChannelCache`), opened through a
TCPStore rendezvous the prefill side hosts; the decode side (`CollectiveKVClient`) asks the
prefill side (`CollectiveKVSender`: OpenChannel, PushKV, CloseChannel) to send a lease's blocks
and receives them as one tensor, on the GPU end to end under nccl; gloo runs the same code on
host memory."""

from __future__ import annotations

from cluster.errors import InvalidArgument
from cluster.kv_transfer.base import ClientParts, KVClient, KVSender
from cluster.kv_transfer.collective.collective_kv_client import CollectiveKVClient
from cluster.kv_transfer.collective.collective_kv_sender import CollectiveKVSender
from cluster.kv_transfer.lease_pins import SenderParts


def make_client(parts: ClientParts) -> KVClient:
    """InvalidArgument if this process cannot run the transport (nccl without CUDA)."""
    if parts.fallback is None:
        raise InvalidArgument("a collective client needs the baseline's client as its fallback")
    return CollectiveKVClient(
        parts.transfer.transport,
        parts.device,
        parts.transfer.fetch_timeout_seconds,
        control=parts.control,
        fallback=parts.fallback,
        max_blocks=parts.max_blocks,
        idle_seconds=parts.transfer.channel_idle_seconds,
    )


def make_sender(parts: SenderParts) -> KVSender:
    """InvalidArgument if this process cannot run `parts.transport`."""
    return CollectiveKVSender(parts)
