"""`GrpcKVClient`'s own checks (its fetches are tested against a real `KVServer` in
tests/prefill_worker/test_kv_server.py, its channels in test_kv_server_stubs.py)."""

from __future__ import annotations

import pytest

from cluster.errors import InvalidArgument
from cluster.kv_transfer.grpc.grpc_kv_client import GrpcKVClient


def test_idle_seconds_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="idle_seconds"):
        GrpcKVClient(1 << 20, timeout_s=1.0, idle_seconds=0)
