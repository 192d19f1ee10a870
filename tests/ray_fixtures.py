"""One local Ray instance and Serve per test session, and a helper to deploy pdserve apps.

Registered from tests/conftest.py. Ray starts lazily, the first time a test asks for it, so
engine-only runs never pay for it; every app a test deploys is deleted again by its fixture.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc
import pytest

from cluster.config import CacheConfig, ModelConfig, SchedulerConfig, TransferConfig
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.replica import REPORT_INTERVAL_S


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServeEndpoints:
    grpc_port: int
    http_port: int
    metrics_port: int

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[ServeEndpoints]:
    import ray
    from ray import serve

    from cluster.serving.app import GRPC_SERVICER, apply_node_env

    apply_node_env()  # the proxies reach the routers as `pdserve serve` deploys them
    # Short metric push intervals so autoscaling and stats react within a test's time.
    os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    ends = ServeEndpoints(free_port(), free_port(), free_port())
    ray.init(
        num_cpus=16,
        include_dashboard=False,
        logging_level="warning",
        log_to_driver=False,  # replicas log to files under the Ray session dir, not the test output
        _metrics_export_port=ends.metrics_port,
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": ends.http_port},
        grpc_options={"port": ends.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
    )
    yield ends
    serve.shutdown()
    ray.shutdown()


def small_app_config(model_dir: str, **overrides) -> AppConfig:
    """Small pools for 2 CPU cores: one torch thread per replica, fractional CPUs."""
    pool = PoolConfig(
        num_cpus=0.25,
        torch_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
    )
    base = AppConfig(
        model=ModelConfig(path=model_dir),
        router=replace(pool, replicas=1),
        prefill=pool,
        decode=pool,
        transfer=TransferConfig(lease_seconds=10.0),
        default_max_tokens=32,
    )
    return replace(base, **overrides)


def deploy(config: AppConfig, name: str, route_prefix: str) -> None:
    from ray import serve

    from cluster.serving.app import build_app

    serve.run(build_app(replace(config, name=name)), name=name, route_prefix=route_prefix)


def stub(ends: ServeEndpoints) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(ends.grpc_target))


def app_metadata(name: str) -> tuple[tuple[str, str], ...]:
    """Serve's gRPC proxy picks the application from this metadata key."""
    return (("application", name),)


def wait_for_idle(ends: ServeEndpoints, app: str, pools: set[str], timeout: float = 20.0):
    """Poll GetStats until every replica of `pools` reports zero used and leased blocks; returns
    those replicas (not the router replicas GetStats also lists, unless asked for).
    Replicas push their stats when they change (sampled every SAMPLE_INTERVAL_S) and at least
    every REPORT_INTERVAL_S, so the first poll waits that long (and a little more): an answer
    from before the caller's requests ended could otherwise pass. A leak then shows up as a
    timeout, never as a pass."""
    s = stub(ends)
    deadline = time.monotonic() + timeout
    time.sleep(REPORT_INTERVAL_S + 0.3)
    while True:
        stats = s.GetStats(pb.GetStatsRequest(), metadata=app_metadata(app))
        replicas = [r for r in stats.replicas if r.pool in pools]
        seen = {r.pool for r in replicas}
        busy = [r for r in replicas if r.kv_blocks_used or r.kv_blocks_leased or r.running]
        if pools <= seen and not busy:
            return replicas
        if time.monotonic() > deadline:
            raise AssertionError(f"KV not back to zero after {timeout}s: {replicas}")
        time.sleep(0.2)
