"""Loopback throughput of the `grpc` KV transport: one real `KVServer` + `GrpcKVClient` pair.

    python -m benchmarks.kv_transfer_bench [--prompt-len 2046] [--chunks 1,4] [--repeats 9]

A prefill engine on the `small` checkpoint (built under ~/.cache/pdserve/models if absent)
prefills one `--prompt-len`-token prompt and leases its KV; then `GrpcKVClient.fetch` pulls that
KV over loopback `--repeats` times per chunk size, the chunk sizes interleaved (A, B, A, B, ...)
in this one process so that noise from other work on the machine hits every variant alike. Each
fetch is checked bit-exact against the pool's own export once. Prints one row per chunk size:
bytes per fetch, median / min fetch ms, and GB/s at the median.

Both ends live in one process and one event loop, as in tests/prefill_worker; on a 2-core
machine the server's and the client's work share the same cores. It lives in `prefill_worker`,
not `benchmarks`, because it runs the prefill worker's `KVServer` and `cluster` may not
import the role packages (tests/test_import_graph.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.model.make_model import make_model
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

DEFAULT_MODEL = Path("~/.cache/pdserve/models/small-v1").expanduser()
BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--prompt-len", type=int, default=2046)
    p.add_argument("--chunks", default="1,4", help="chunk sizes in MiB, comma separated")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p.parse_args()


async def bench(args: argparse.Namespace) -> None:
    if not args.model_dir.exists():
        make_model("small", args.model_dir)
    num_blocks = -(-args.prompt_len // BLOCK_SIZE) + 8
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    config = EngineConfig(ModelConfig(str(args.model_dir)), cache, role="prefill")
    engine = AsyncEngine(Engine(config))
    engine.start()
    leases = LeaseKeeper(engine, 600.0, Capability(b"bench-secret"))
    sizes = [int(float(s) * (1 << 20)) for s in args.chunks.split(",")]
    server = KVServer(engine, leases, engine.engine.layout, "127.0.0.1", 0, max(sizes))
    endpoint = await server.start()
    clients = {size: GrpcKVClient(size, timeout_s=60.0, max_blocks=num_blocks) for size in sizes}
    try:
        gen = torch.Generator().manual_seed(0)
        ids = tuple(torch.randint(0, 1000, (args.prompt_len,), generator=gen).tolist())
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        async for _ in await engine.generate(Request("bench", ids, params, prefill_only=True)):
            pass
        prefill_s = time.perf_counter() - t0
        block_ids, num_tokens, expiry, token = await leases.grant("bench")
        handle = KVHandle(
            request_id="bench",
            num_tokens=num_tokens,
            endpoint=endpoint,
            transport="grpc",
            block_ids=tuple(block_ids),
            block_size=BLOCK_SIZE,
            layout=engine.engine.layout,
            lease_expiry_unix=expiry,
            capability_token=token,
        )
        layout = engine.engine.layout
        want = await engine.call(lambda e: e.export_kv("bench"))
        nbytes = 2 * want.k.numel() * want.k.element_size()
        for client in clients.values():  # warm up each channel, and check the copy is exact
            got = await client.fetch(handle, layout)
            assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v), "KV mismatch"
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for _ in range(args.repeats):
            for size, client in clients.items():
                t0 = time.perf_counter()
                await client.fetch(handle, layout)
                times[size].append(time.perf_counter() - t0)
        await leases.release("bench", "aborted")
    finally:
        for client in clients.values():
            await client.close()
        await server.stop(0)
        await leases.stop()
        await engine.stop()

    print(
        f"KV of {args.prompt_len} tokens, {layout.num_layers} layers x {layout.num_kv_heads} "
        f"KV heads x {layout.head_dim} ({layout.dtype}); prefill took {prefill_s:.1f} s; "
        f"torch threads {torch.get_num_threads()}; {args.repeats} fetches per chunk size"
    )
    print(f"{'chunk MiB':>10} {'bytes':>12} {'median ms':>10} {'min ms':>8} {'GB/s':>6}")
    for size in sizes:
        med = statistics.median(times[size])
        print(
            f"{size / (1 << 20):>10.2f} {nbytes:>12} {med * 1e3:>10.1f} "
            f"{min(times[size]) * 1e3:>8.1f} {nbytes / med / 1e9:>6.2f}"
        )


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
