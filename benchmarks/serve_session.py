"""Serve for the benchmarks that deploy apps: a local Ray and Serve of their own (or the one
already running), their apps deployed for a block and deleted after, and small pools for a
machine of a few cores.

The role classes are named by import path (`cluster.serving.app.compose_app`), so Ray's workers
import them: run the benchmarks from the repository root (`python -m benchmarks.<name>`), whose
directory Ray puts on its workers' path.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from benchmarks.options import model_dir
from benchmarks.report import log
from cluster.config import CacheConfig, SchedulerConfig
from cluster.serving.app_config import AppConfig, PoolConfig

T = TypeVar("T")


@contextlib.contextmanager
def local_serve() -> Iterator[int]:
    """A fresh local Ray of our own (never someone else's cluster) with Serve and its gRPC
    proxy, set up as `pdserve serve` sets up its local Ray; yields the proxy's gRPC port."""
    import ray
    from ray import serve

    from cluster.serving.app import GRPC_SERVICER, apply_node_env

    apply_node_env()
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning")
    try:
        grpc_port, http_port = free_port(), free_port()
        serve.start(
            http_options={"host": "127.0.0.1", "port": http_port},
            grpc_options={"port": grpc_port, "grpc_servicer_functions": [GRPC_SERVICER]},
        )
        try:
            yield grpc_port
        finally:
            serve.shutdown()
    finally:
        ray.shutdown()


def deploy(config: AppConfig, role_classes: Mapping[str, str] | None = None) -> None:
    """The app of `config` on the running Serve, named by its `name`, at route /name."""
    from ray import serve

    from cluster.serving.app import compose_app

    log(f"deploying {config.name}")
    app = compose_app(config, role_classes)
    serve.run(app, name=config.name, route_prefix=f"/{config.name}")


def delete(name: str) -> None:
    """Delete app `name` from the running Serve; a failure is logged, not raised."""
    from ray import serve

    try:
        serve.delete(name)
    except Exception as e:  # never deployed, or Serve is going away
        log(f"could not delete app {name}: {e}")


@contextlib.contextmanager
def deployed(
    configs: list[AppConfig], role_classes: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Each app deployed (`deploy`) for the block; all of them deleted after, whatever
    happened."""
    try:
        for cfg in configs:
            deploy(cfg, role_classes)
        yield
    finally:
        for cfg in configs:
            delete(cfg.name)


def on_serve(grpc_port: int, measure: Callable[[int], T]) -> T:
    """`measure(port)` on the Serve whose gRPC proxy listens on `grpc_port`, or, when it is 0,
    on a local Ray and Serve started for it and shut down after."""
    if grpc_port:
        return measure(grpc_port)
    with local_serve() as port:
        return measure(port)


def measure_served(a: argparse.Namespace, measure: Callable[[str, int], T]) -> tuple[T, float]:
    """`measure(checkpoint dir, grpc port)` with `served_parser`'s options; returns its result
    and the wall seconds it took."""
    checkpoint = str(model_dir(a))
    began = time.perf_counter()
    result = on_serve(a.grpc_port, lambda port: measure(checkpoint, port))
    return result, time.perf_counter() - began


def kv_transport(config: AppConfig) -> str:
    """The KV transport `config`'s app moves KV with on this node ("auto" resolved)."""
    return config.resolved().transfer.transport


def small_pool(num_blocks: int, max_num_seqs: int) -> PoolConfig:
    """A pool for these benchmarks on a few cores: one torch thread an engine, a quarter CPU
    a replica for Ray's accounting, 16-token KV blocks, prefill chunks of 512 tokens."""
    return PoolConfig(
        num_cpus=0.25,
        torch_threads=1,
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
