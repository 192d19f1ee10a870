"""The KV transports side by side: grpc, gloo and nixl moving one prompt's KV between processes.

    python -m benchmarks.kv_transports_bench [--prompt-lens 512,2046] [--repeats 5] [--out FILE]

A prefill process (a real engine on the `small` checkpoint, a LeaseKeeper and a KVServer serving
nixl and grpc; then another serving gloo) prefills one prompt per length and leases its KV; this
process, the decode side, moves it into blocks of its own paged pool with the transport's
`KVClient.fetch_into`, as a decode worker does, `--repeats` times per length after one warm-up
(the pair's connection or group is set up then), the transports served by one prefill process
interleaved (A, B, C, A, B, C, ...) so that noise from other work on the machine hits them
alike, and checks the blocks bit-exact against the prefill side's export. The row "grpc,
checksum + copy" is the gRPC path as it was before this benchmark was written: chunk checksums
on, assembled into new tensors, then copied into the pool. KV share of TTFT = transfer /
(prefill + transfer): the time until the decode side can run, of which the transfer is the part
disaggregation adds.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import replace

import torch

from benchmarks.options import common_parser, model_dir
from benchmarks.report import header, publish
from cluster.config import CacheConfig, EngineConfig, ModelConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVCache
from cluster.kv_transfer.capability import Capability
from cluster.kv_transfer.collective_kv_client import CollectiveKVClient
from cluster.kv_transfer.grpc_kv_client import GrpcKVClient
from cluster.kv_transfer.kv_client import KVClient
from cluster.kv_transfer.kv_handle import KVHandle
from cluster.kv_transfer.nixl_kv_client import NixlKVClient
from cluster.pb.pdserve.v1 import kv_transfer_pb2 as pb
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from prefill_worker.kv_server import KVServer
from prefill_worker.lease_keeper import LeaseKeeper

BLOCK_SIZE, CHUNK = 16, 4 << 20
# Per prefill process (the transport its KV server serves besides grpc), the rows measured
# against it, interleaved. "grpc, checksum + copy" is the gRPC path before issue 19.
GROUPS = {"nixl": ("grpc, checksum + copy", "grpc", "nixl"), "gloo": ("gloo",)}


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common_parser(__doc__, "kv_transports")
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
                    fetch_into = KVClient.fetch_into if "copy" in name else type(client).fetch_into
                    rows[name][2][n] = await fetch_into(client, handle, pool, ids)
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
    if name.startswith("grpc"):
        return GrpcKVClient(CHUNK, 60.0, max_blocks=num_blocks, checksum="checksum" in name)
    if name == "gloo":
        return CollectiveKVClient("gloo", pool.k.device, CHUNK, 60.0, max_blocks=num_blocks)
    return NixlKVClient(pool, CHUNK, 60.0, max_blocks=num_blocks)


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
            k, v = await engine.call(lambda e, rid=rid: e.kv_cache.read(e.held_blocks(rid)[0]))
            handle = KVHandle(
                rid, num_tokens, endpoint, transport, tuple(block_ids), BLOCK_SIZE,
                engine.layout, expiry, token,
            )  # fmt: skip
            kv = (k.cpu(), v.cpu())
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
