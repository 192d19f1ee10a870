"""Loopback throughput of the `grpc` KV transport: one real `KVServer` + `GrpcKVClient` pair.

    python -m benchmarks.kv_transfer_bench [--prompt-len 2046] [--chunks 1,4] [--repeats 9]
        [--out FILE]

A prefill engine on the `small` checkpoint (the cached one, built on first use) prefills one
`--prompt-len`-token prompt and leases its KV; then `GrpcKVClient.fetch` pulls that KV over
loopback `--repeats` times per chunk size, the chunk sizes interleaved (A, B, A, B, ...) in this
one process so that noise from other work on the machine hits every variant alike. Each fetch
is checked bit-exact against the pool's own export once. Reports one row per chunk size: bytes
per fetch, median / min fetch ms, and GB/s at the median.

Both ends live in one process and one event loop, as in tests/prefill_worker; on a 2-core
machine the server's and the client's work share the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks.options import common_parser, model_dir, with_threads
from benchmarks.report import header, publish
from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVLayout
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Fetches:
    layout: KVLayout
    prefill_s: float
    nbytes: int  # K + V bytes per fetch
    times: dict[int, list[float]]  # chunk bytes -> seconds of each timed fetch
    threads: int  # torch threads


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common_parser(__doc__, "kv_transfer")
    p.add_argument("--prompt-len", type=int, default=2046)
    p.add_argument("--chunks", default="1,4", help="chunk sizes in MiB, comma separated")
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    fetches = with_threads(a.threads, lambda: asyncio.run(measure(a)))
    return publish(render(a, argv, fetches), a.out)


async def measure(a: argparse.Namespace) -> Fetches:
    num_blocks = -(-a.prompt_len // BLOCK_SIZE) + 8
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    engine = AsyncEngine(Engine(EngineConfig(ModelConfig(str(model_dir(a))), cache)))
    engine.start()
    leases = LeaseKeeper(engine, 600.0, Capability(b"bench-secret"))
    sizes = [int(float(s) * (1 << 20)) for s in a.chunks.split(",")]
    server = KVServer(engine, leases, engine.layout, "127.0.0.1", 0, max(sizes))
    endpoint = await server.start()
    clients = {size: GrpcKVClient(size, timeout_s=60.0, max_blocks=num_blocks) for size in sizes}
    try:
        prefill_s = await _prefill(engine, a.prompt_len)
        block_ids, num_tokens, expiry, token = await leases.grant("bench")
        handle = KVHandle(
            request_id="bench",
            num_tokens=num_tokens,
            endpoint=endpoint,
            transport="grpc",
            block_ids=tuple(block_ids),
            block_size=BLOCK_SIZE,
            layout=engine.layout,
            lease_expiry_unix=expiry,
            capability_token=token,
        )
        want_k, want_v = await engine.call(lambda e: e.kv_cache.read(e.held_blocks("bench")[0]))
        for client in clients.values():  # warm up each channel, and check the copy is exact
            got = await client.fetch(handle, engine.layout)
            assert torch.equal(got.k, want_k) and torch.equal(got.v, want_v), "KV mismatch"
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for _ in range(a.repeats):
            for size, client in clients.items():
                t0 = time.perf_counter()
                await client.fetch(handle, engine.layout)
                times[size].append(time.perf_counter() - t0)
        await leases.release("bench", "aborted")
    finally:
        for client in clients.values():
            await client.close()
        await server.stop(0)
        await leases.stop()
        await engine.stop()
    nbytes = 2 * want_k.numel() * want_k.element_size()
    return Fetches(engine.layout, prefill_s, nbytes, times, torch.get_num_threads())


async def _prefill(engine: AsyncEngine, prompt_len: int) -> float:
    """Prefill request "bench" (its KV stays held for a lease); returns the seconds it took."""
    gen = torch.Generator().manual_seed(0)
    ids = tuple(torch.randint(0, 1000, (prompt_len,), generator=gen).tolist())
    # Two tokens: the prefill's, and one more so its KV is held (and a 2046-token prompt fits
    # the presets' 2048-token context).
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    async for _ in await engine.generate(Request("bench", ids, params, prefill_only=True)):
        pass
    return time.perf_counter() - t0


def render(a: argparse.Namespace, argv: list[str], f: Fetches) -> str:
    layout = f.layout
    lines = [
        *header("KV transfer over loopback gRPC", "kv_transfer_bench", argv),
        f"- KV of {a.prompt_len} tokens, {layout.num_layers} layers x {layout.num_kv_heads} "
        f"KV heads x {layout.head_dim} ({layout.dtype}), `{a.preset}` preset; prefill took "
        f"{f.prefill_s:.1f} s; {f.threads} torch thread(s); {a.repeats} fetches "
        "per chunk size, interleaved, after one checked warm-up fetch each",
        "",
        "| chunk (MiB) | bytes per fetch | median (ms) | min (ms) | GB/s at the median |",
        "|---|---|---|---|---|",
    ]
    for size, times in f.times.items():
        med = statistics.median(times)
        lines.append(
            f"| {size / (1 << 20):.2f} | {f.nbytes} | {med * 1e3:.1f} | "
            f"{min(times) * 1e3:.1f} | {f.nbytes / med / 1e9:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
