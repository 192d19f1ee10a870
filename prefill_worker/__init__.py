"""The prefill deployment: prefill scheduling, KV leases and the KV server."""

from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

__all__ = ["KVServer", "LeaseKeeper"]
