"""The prefill deployment: `PrefillWorker` computes prompts and puts their KV under leases
(`LeaseKeeper`); `KVServer` serves the leased KV to decode workers, mounting the RPC handlers
of the KV transports' senders (`cluster.kv_transfer`) beside ReleaseKV and CancelPrefill."""

from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

__all__ = ["KVServer", "LeaseKeeper"]
