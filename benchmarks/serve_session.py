"""Serve for the benchmarks that deploy apps: a local Ray and Serve of their own (or the one
already running), their apps deployed for a block and deleted after, small pools for a
machine of a few cores, and the calls over its gRPC proxy (route ready, KV blocks in use).

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

import grpc

from benchmarks.report import log, model_dir
from cluster.config import CacheConfig, SchedulerConfig
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
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


@contextlib.contextmanager
def deployed(
    configs: list[AppConfig], role_classes: Mapping[str, str] | None = None
) -> Iterator[None]:
    """Each app of `configs` deployed on the running Serve for the block, named by its `name`
    at route /name; all of them deleted after, whatever happened."""
    from ray import serve

    from cluster.serving.app import compose_app

    try:
        for cfg in configs:
            log(f"deploying {cfg.name}")
            serve.run(compose_app(cfg, role_classes), name=cfg.name, route_prefix=f"/{cfg.name}")
        yield
    finally:
        for cfg in configs:
            try:
                serve.delete(cfg.name)
            except Exception as e:  # never deployed, or Serve is going away
                log(f"could not delete app {cfg.name}: {e}")


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


def stub(grpc_port: int) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))


def wait_ready(stub, app: str, prompt: list[int], timeout: float = 120.0) -> None:
    """The proxy learns routes a little after `serve.run` returns: retry until a request of
    four tokens goes through."""
    sampling = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = [m for m in stub.Generate(request, metadata=(("application", app),))]
            assert sum(len(m.token_ids) for m in got) == 4, f"{app}: not 4 tokens"
            return
        except grpc.RpcError as e:
            if time.monotonic() > deadline or e.code() not in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.NOT_FOUND,
            ):
                raise
            time.sleep(0.5)


def used_blocks(stub, app: str, timeout_s: float = 30.0) -> int:
    """KV blocks in use or leased over the app's replicas, once they settle (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.GetStats(pb.GetStatsRequest(), metadata=(("application", app),))
        used = sum(r.kv_blocks_used + r.kv_blocks_leased for r in stats.replicas)
        if not used or time.monotonic() > deadline:
            return used
        time.sleep(0.5)
