"""Payloads between the router and the two pools (passed through Ray Serve handles)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.kv_transfer.kv_handle import KVHandle
from cluster.request import Request, StepOutput


@dataclass(frozen=True)
class PrefillResult:
    """The prefill hop's answer: the first token (already a whole `StepOutput`) and, unless the
    request finished on it, the handle to the prompt's KV, pinned under a lease."""

    first: StepOutput
    handle: KVHandle | None
    replica_id: str
    queue_seconds: float
    prefill_seconds: float


@dataclass(frozen=True)
class TokenRoute:
    """Where a worker sends a request's outputs in the token stream: the router's token
    server (host:port) and the stream's key, a random secret only the router and this call
    know; the router drops a connection that sends a stream's outputs with another key."""

    endpoint: str
    key: bytes


@dataclass(frozen=True)
class DecodeRequest:
    request: Request
    handle: KVHandle
    first_token: int


@dataclass(slots=True)
class WorkerChunk:
    """One streamed step of a decode (or colocated) worker. The first chunk of a stream carries
    the worker's phase times; later ones leave them at zero. A value, not declared frozen for
    the reason `StepOutput` gives (one per stream per step)."""

    output: StepOutput
    replica_id: str
    kv_transfer_seconds: float = 0.0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0


@dataclass(frozen=True)
class RankPlace:
    """Where one tensor-parallel rank of an engine replica runs: its Ray node (id and IP as Ray
    knows them; empty outside Ray) and its process id. Rank 0 is the replica's own process;
    ranks 1..k-1 are processes it started, so on its node."""

    rank: int
    node_id: str
    node_ip: str
    pid: int


# `ReplicaStats.state`: the replica serves, or its engine is still starting.
READY, LOADING = "ready", "loading"


@dataclass(frozen=True)
class ReplicaStats:
    """One engine replica's numbers as of `updated_at` (wall clock). `kv_leases_ended`, on
    prefill replicas: how many leases ended so far, by reason (fetched, cancelled, aborted,
    expired); `kv_endpoint`, on prefill replicas: the KV server's "host:port" (where a router
    sends `CancelPrefill`); `device` and `dtype`: where and in what the replica's engine runs,
    as it decided them ("auto" is decided by each replica, `replica_device`);
    `tensor_parallel_size`: the ranks its engine spans (0 on router replicas); `ranks`: where
    each runs (`RankPlace`, rank 0 first; empty while loading); `prompt_tokens`:
    the tokens of the prompts it prefilled so far (prefill replicas; the ratio policy's mix). A
    router replica reports itself too (pool "router", every figure 0, no device):
    `grpc_endpoint` is where it serves `pdserve.v1.Generation` without Serve's proxy. `state`:
    READY, or LOADING while the replica's engine starts (a hub model downloading into the
    node's cache, the weights loading; every figure 0, `loading_report.LoadingReport`)."""

    pool: str
    replica_id: str
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_leased: int
    running: int
    waiting: int
    queued_prompt_tokens: int
    kv_blocks_cached: int = 0
    generated_tokens: int = 0
    updated_at: float = 0.0
    kv_leases_ended: dict[str, int] = field(default_factory=dict)
    kv_endpoint: str = ""
    grpc_endpoint: str = ""
    device: str = ""
    dtype: str = ""
    tensor_parallel_size: int = 0
    state: str = "ready"  # READY or LOADING
    prompt_tokens: int = 0
    ranks: tuple[RankPlace, ...] = ()
