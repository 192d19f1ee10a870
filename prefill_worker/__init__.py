"""The prefill deployment: `PrefillWorker` computes prompts and puts their KV under leases
(`LeaseKeeper`); `KVServer` serves the leased KV to decode workers over every transport
(`GrpcKVSender` for grpc, `CollectiveKVSender` for gloo and nccl, `NixlKVSender` for nixl)."""

from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

__all__ = ["KVServer", "LeaseKeeper"]
