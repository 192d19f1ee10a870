"""Disaggregated against colocated on the same number of engines: the Mooncake trace replayed
on both, side by side in one run.

    python -m benchmarks.trace_bench [--preset small] [--trace FILE] [--skip 3800]
        [--max-requests 60] [--time-scale 8] [--out FILE]

Two apps on one local Ray, each with two engines of one torch thread: "disaggregated" (1
prefill + 1 decode replica) and "colocated" (2 replicas doing both). The same trace window
(`cluster.client.workload`, lengths x 1/32, clock scaled; prompts sharing `hash_ids` share
tokens) goes to one app, then the other, open loop, by `pdserve bench`'s load generator. Prints
each app's summary, both side by side with ratios, and checks both gave the same tokens for
every request and left no KV blocks in use. The default window's prompts share prefixes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, replace

from benchmarks.report import header, log, publish, served_parser
from benchmarks.serve_session import (
    deployed,
    kv_transport,
    measure_served,
    small_pool,
    stub,
    used_blocks,
    wait_ready,
)
from cluster.client.bench_summary import PERCENTILES, BenchSummary
from cluster.client.load_generator import RequestRecord, model_info, run_workload
from cluster.client.workload import TRACES, TraceScale, Workload, load_trace, trace_workload
from cluster.config import ModelConfig
from cluster.serving.app_config import AppConfig

APPS = {"disaggregated": "trace-pd", "colocated": "trace-co"}
# The Mooncake trace shipped in the package (cluster/client/traces/, with its NOTICE).
SHARED_TRACE = TRACES["mooncake"]


@dataclass
class Replay:
    records: list[RequestRecord]
    summary: BenchSummary
    used_blocks_after: int


@dataclass
class TraceRun:
    work: Workload
    replays: dict[str, Replay]  # mode -> its replay
    kv_transport: str  # the disaggregated app's


def app_config(a: argparse.Namespace, model_dir: str, mode: str, name: str) -> AppConfig:
    pool = small_pool(a.num_blocks, max_num_seqs=32)
    engines = replace(pool, replicas=2) if mode == "colocated" else pool
    return AppConfig(
        model=ModelConfig(path=model_dir),
        router=replace(pool, replicas=1),
        prefill=pool,
        decode=engines,
        mode=mode,
        name=name,
    )


def workload(a: argparse.Namespace, info) -> Workload:
    scale = TraceScale(time=a.time_scale)
    entries = load_trace(a.trace, a.max_requests, a.skip)
    return trace_workload(entries, scale, info.vocab_size, info.max_context_length, 0)


def measure(a: argparse.Namespace, model_dir: str, grpc_port: int) -> TraceRun:
    target = f"127.0.0.1:{grpc_port}"
    proxy = stub(grpc_port)
    configs = [app_config(a, model_dir, mode, name) for mode, name in APPS.items()]
    results: dict[str, Replay] = {}
    with deployed(configs):
        for name in APPS.values():
            wait_ready(proxy, name, list(range(16, 48)))
        info = asyncio.run(model_info(target, APPS["disaggregated"]))
        work = workload(a, info)
        for mode, name in APPS.items():
            log(f"replaying {len(work.requests)} requests on {name}")
            records = asyncio.run(run_workload(target, work, name, timeout_s=600.0))
            results[mode] = Replay(records, BenchSummary.of(records), used_blocks(proxy, name))
    return TraceRun(work, results, kv_transport(configs[0]))


def render(a: argparse.Namespace, argv: list[str], run: TraceRun, wall_s: float) -> str:
    work, res = run.work, run.replays
    pd, co = res["disaggregated"].summary, res["colocated"].summary
    lines = [
        *header("pdserve trace replay: disaggregated against colocated", "trace_bench", argv),
        f"- wall time {wall_s:.0f} s",
        f"- trace: {a.trace}, requests {a.skip}-{a.skip + len(work.requests) - 1}; "
        f"{work.description}; "
        f"{sum(r.clipped for r in work.requests)} prompts cut to fit the context",
        f"- apps: disaggregated 1 prefill + 1 decode replica, colocated 2 replicas; one torch "
        f"thread per engine, {a.num_blocks} KV blocks of 16 tokens per replica, KV transport "
        f"{run.kv_transport}; sent to disaggregated first, then colocated",
        "",
        "| | disaggregated | colocated | disaggregated / colocated |",
        "|---|---|---|---|",
    ]

    def row(name: str, x: float, y: float, fmt: str = "{:.1f}") -> None:
        ratio = f"{x / y:.2f}x" if y else "n/a"
        lines.append(f"| {name} | {fmt.format(x)} | {fmt.format(y)} | {ratio} |")

    row("requests completed", pd.completed, co.completed, "{:d}")
    row("output tokens/s", pd.output_throughput, co.output_throughput)
    for label, attr in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e")):
        d_pd, d_co = getattr(pd, attr), getattr(co, attr)
        row(f"{label} mean (ms)", d_pd.mean * 1e3, d_co.mean * 1e3)
        for p in PERCENTILES:
            row(f"{label} p{p} (ms)", d_pd.pct[p] * 1e3, d_co.pct[p] * 1e3)
    row("prompt tokens from the prefix cache", pd.cached_prompt_tokens, co.cached_prompt_tokens,
        "{:d}")  # fmt: skip
    same = all(
        x.token_ids == y.token_ids
        for x, y in zip(res["disaggregated"].records, res["colocated"].records, strict=True)
        if x.ok and y.ok
    )
    lines += [
        f"| KV blocks used or leased after the run | {res['disaggregated'].used_blocks_after} | "
        f"{res['colocated'].used_blocks_after} | |",
        "",
        f"Same tokens from both apps for every request: {'yes' if same else 'NO'}. "
        f"An unbounded prefix cache could serve {work.reusable_tokens} of the "
        f"{work.prompt_tokens} prompt tokens.",
    ]
    for mode, r in res.items():
        lines += ["", f"## {mode}", "", *r.summary.render()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = served_parser(__doc__, "trace")
    p.add_argument("--trace", default=str(SHARED_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--skip", type=int, default=3800, help="start after this many requests")
    p.add_argument("--max-requests", type=int, default=60)
    p.add_argument("--time-scale", type=float, default=8.0)
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    a = p.parse_args(argv)
    run, wall_s = measure_served(a, lambda model_dir, port: measure(a, model_dir, port))
    return publish(render(a, argv, run, wall_s), a.out)


if __name__ == "__main__":
    main()
