"""Frozen, validated configuration, composed at the top; each component gets only its slice."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from cluster.errors import InvalidArgument

TransportName = Literal["auto", "grpc", "nixl", "gloo", "nccl"]
TRANSPORTS = ("auto", "grpc", "nixl", "gloo", "nccl")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load, and where it runs. `path` is a Hugging Face checkpoint dir."""

    path: str
    dtype: str = "float32"
    device: str = "cpu"
    # A context longer than the checkpoint's max_position_embeddings is refused; 0 = use it.
    max_model_len: int = 0
    # fp32 on the CPU: also keep every linear weight packed for MKL's GEMM
    # (cluster/model/linear.py), which makes the GEMMs of decode batches of 4-96 sequences
    # 5-35% faster and costs about as much memory again as the weights.
    packed_weights: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise InvalidArgument(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len < 0:
            raise InvalidArgument("max_model_len must be >= 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens each, in every layer."""

    block_size: int = 16
    num_blocks: int = 1024
    # Keep the KV of finished prompts' full blocks, reclaimable, and reuse it for any later
    # prompt that starts with the same tokens (cluster/engine/block_manager.py).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidArgument(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks <= 0:
            raise InvalidArgument(f"num_blocks must be positive, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take on."""

    max_num_seqs: int = 128  # running sequences at once
    max_num_batched_tokens: int = 512  # token budget per step; longer prompts are chunked
    max_waiting: int = 4096  # admission queue bound; beyond it requests are refused

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_waiting <= 0:
            raise InvalidArgument("scheduler limits must be positive")


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves from a prefill worker to a decode worker.

    `secret` keys the HMAC capability tokens; every worker of one cluster must share it (the app
    builder generates one when it is empty). `host` is the address the prefill worker's KV
    server, and the router's token stream server, bind and advertise ("auto" = this node's
    Ray address); port 0 picks a free port (the token stream server always picks one).

    `transport` "auto" is decided when the app is built (`AppConfig.resolved`): "nixl" where
    NIXL imports and two agents move bytes to each other, else "grpc". `checksum` adds a
    checksum of every gRPC chunk, computed by the sender and checked by the receiver (headers
    and shapes are always checked); off, the chunk bytes are not read beyond their copies."""

    transport: TransportName = "auto"
    host: str = "127.0.0.1"
    port: int = 0
    lease_seconds: float = 30.0
    # Both ends raise gRPC's message limit to this plus framing; 4 MiB measured fastest on
    # loopback (benchmarks/kv_transfer_bench.py).
    max_chunk_bytes: int = 4 << 20
    fetch_timeout_seconds: float = 30.0
    # A decode worker's channel to a prefill worker (gRPC; gloo/nccl: the pair's process group)
    # is closed after this long unused (gRPC: and at least fetch_timeout_seconds).
    channel_idle_seconds: float = 60.0
    secret: str = ""
    checksum: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise InvalidArgument(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if min(self.lease_seconds, self.fetch_timeout_seconds, self.channel_idle_seconds) <= 0:
            raise InvalidArgument(
                "lease_seconds, fetch_timeout_seconds and channel_idle_seconds must be positive"
            )
        if not 4096 <= self.max_chunk_bytes <= 64 << 20:
            raise InvalidArgument("max_chunk_bytes must be in [4 KiB, 64 MiB]")
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"port out of range: {self.port}")


def resolve_host(host: str) -> str:
    """The address to bind and advertise for `host`: "auto" is this node's Ray address."""
    if host != "auto":
        return host
    import socket

    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    default_max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.default_max_tokens <= 0:
            raise InvalidArgument("default_max_tokens must be positive")
