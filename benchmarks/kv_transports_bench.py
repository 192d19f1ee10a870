"""The KV transports side by side: grpc, gloo and nixl moving one prompt's KV between processes.

    python -m benchmarks.kv_transports_bench [--prompt-lens 512,2046] [--repeats 5] [--out FILE]

A prefill process (a real engine on the `small` checkpoint, a LeaseKeeper and a KVServer serving
nixl and grpc; then one serving gloo) prefills one prompt per length and leases its KV; this
process, the decode side, moves it into its own paged pool with a decode worker's KV client
(`make_kv_client`, `fetch_into`), `--repeats` times per length after one warm-up (which sets up
the pair's connection or group), the transports of one prefill process interleaved (A, B, A, B)
so that other work's noise hits them alike, and checks the blocks bit-exact against the prefill
side's. KV share of TTFT = transfer / (prefill + transfer): of the time until the decode side
can run, the part disaggregation adds.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import replace

import torch

from benchmarks.report import add_threads_option, header, model_dir, parser, publish
from cluster.config import CacheConfig, EngineConfig, ModelConfig, TransferConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVCache
from cluster.kv_transfer.base import KVClient
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.transport_factory import make_kv_client
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

BLOCK_SIZE, CHUNK = 16, 4 << 20
# Per prefill process (the transport its KV server serves besides grpc), the transports measured
# against it, interleaved.
GROUPS = {"nixl": ("grpc", "nixl"), "gloo": ("gloo",)}


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(__doc__, "kv_transports")
    add_threads_option(p)
    p.add_argument("--prompt-lens", default="512,2046")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu", help="both pools' device (cuda: nixl over CUDA IPC)")
    a = p.parse_args(argv)
    lens = [int(n) for n in a.prompt_lens.split(",")]
    rows = {}
    for server, names in GROUPS.items():
        rows.update(asyncio.run(measure(a, server, names, lens)))
    return publish(render(argv, a, lens, rows), a.out)


async def measure(a, transport: str, names: tuple[str, ...], lens: list[int]) -> dict:
    """{row name: (prefill seconds, median transfer seconds, bytes), each by prompt length}."""
    num_blocks = -(-max(lens) // BLOCK_SIZE) + 4
    parent, child = mp.get_context("spawn").Pipe()
    args = (child, str(model_dir(a)), transport, num_blocks, a.threads, a.device)
    proc = mp.get_context("spawn").Process(target=_prefill_side, args=args, daemon=True)
    proc.start()
    rows: dict = {name: ({}, {}, {}) for name in names}
    clients: dict[str, KVClient] = {}
    try:
        for n in lens:
            parent.send(n)
            raw, prefill_s, k_want, v_want = await asyncio.to_thread(parent.recv)
            handle = KVHandle.from_proto(pb.KVHandle.FromString(raw))
            if not clients:
                pool = KVCache(handle.layout, num_blocks, k_want.dtype, torch.device(a.device))
                clients = {name: _client(name, pool, num_blocks) for name in names}
            ids = list(range(len(handle.block_ids)))
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(a.repeats + 1):  # the first round sets up each pair's connection
                for name, client in clients.items():
                    rows[name][0][n] = prefill_s
                    handle = replace(handle, transport="nixl" if name == "nixl" else transport)
                    pool.k.zero_()
                    pool.v.zero_()
                    t0 = time.perf_counter()
                    rows[name][2][n] = await client.fetch_into(handle, pool, ids)
                    times[name].append(time.perf_counter() - t0)
                    assert torch.equal(pool.k[:, ids].cpu(), k_want), name
                    assert torch.equal(pool.v[:, ids].cpu(), v_want), name
            for name in names:
                rows[name][1][n] = statistics.median(times[name][1:])
            await next(iter(clients.values())).release(handle, "fetched")
    finally:
        parent.send(None)
        for client in clients.values():
            await client.close()
        proc.join(30)
    return rows


def _client(name: str, pool: KVCache, num_blocks: int) -> KVClient:
    transfer = TransferConfig(transport=name, max_chunk_bytes=CHUNK, fetch_timeout_seconds=60.0)
    return make_kv_client(transfer, pool.k.device, num_blocks, pool)


def _prefill_side(conn, path: str, transport: str, num_blocks: int, threads: int, device: str):
    if threads:
        torch.set_num_threads(threads)
    asyncio.run(_serve(conn, path, transport, num_blocks, device))


async def _serve(conn, path: str, transport: str, num_blocks: int, device: str) -> None:
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks)
    engine = AsyncEngine(Engine(EngineConfig(ModelConfig(path, device=device), cache)))
    engine.start()
    leases = LeaseKeeper(engine, 3600.0, Capability(b"bench-secret"))
    server = KVServer(engine, leases, engine.layout, "127.0.0.1", 0, CHUNK, transport=transport)
    endpoint = await server.start()
    try:
        while (n := await asyncio.to_thread(conn.recv)) is not None:
            rid = f"bench-{n}"
            ids = tuple(torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)))
            params = SamplingParams(max_tokens=2)
            request = Request(rid, tuple(int(t) for t in ids), params, prefill_only=True)
            t0 = time.perf_counter()
            async for _ in await engine.generate(request):
                pass
            prefill_s = time.perf_counter() - t0
            block_ids, num_tokens, expiry, token = await leases.grant(rid)
            want = await engine.call(lambda e, ids=list(block_ids): e.kv_cache.read(ids))
            handle = KVHandle(
                rid, num_tokens, endpoint, transport, tuple(block_ids), BLOCK_SIZE,
                engine.layout, expiry, token,
            )  # fmt: skip
            kv = (want[0].cpu(), want[1].cpu())
            conn.send((handle.to_proto().SerializeToString(), prefill_s, *kv))
    finally:
        await server.stop(0)
        await leases.stop()
        await engine.stop()


def render(argv: list[str], a, lens: list[int], rows) -> str:
    lines = [
        *header("KV transports side by side", "kv_transports_bench", argv, a.device),
        f"- `{a.preset}` preset, float32 KV, blocks of {BLOCK_SIZE} tokens, pools on "
        f"{a.device}; prefill and decode sides in two processes on this machine; median of "
        f"{a.repeats} transfers after one warm-up, interleaved, each into the decode pool's "
        "blocks and checked bit-exact",
        "- KV share of TTFT = transfer / (prefill + transfer)",
        "",
        "| transport | prompt tokens | KV MB | transfer ms | GB/s | prefill ms "
        "| KV share of TTFT |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (prefill_s, moved_s, nbytes) in rows.items():
        for n in lens:
            t, pre = moved_s[n], prefill_s[n]
            lines.append(
                f"| {name} | {n} | {nbytes[n] / 1e6:.2f} | {t * 1e3:.3f} | "
                f"{nbytes[n] / t / 1e9:.4f} | {pre * 1e3:.0f} | {100 * t / (pre + t):.1f}% |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
