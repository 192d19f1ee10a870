"""Tensor parallelism on the CPU (gloo): what a TP 2 decode step spends in collectives beside
TP 1, and what KV costs per prompt token between pools of each pair of TP sizes, per transport.

    python -m benchmarks.tp_bench [--preset tiny] [--batch 8] [--steps 40] [--prompt-len 512]
        [--transports grpc,nixl]

Steps: a TP 1 engine (2 torch threads) and a TP 2 replica (1 thread a rank) decode the same
batch in alternating rounds; the TP 2 leader's all-reduce, all-gather and step-message time is
timed inside its steps. KV: one prefill replica per TP size behind a KV server (and rank KV
servers) and one decode replica per TP size; each pair's move of one prompt's KV into reserved
blocks (`ShardedKVClient.fetch_into`) is timed, the pairs interleaved, P1 -> D1 (one whole
FetchKV, or one whole-pool NIXL READ) each transport's baseline. Each transport gets a harness of
its own (grpc: head-sliced FetchKV; nixl: head-sliced READs, rank to rank), run one after the
other.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from contextlib import ExitStack

import torch

from benchmarks.report import header, model_dir, parser, publish
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.engine.tp_replica import TPReplica
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from tests.tp_pairs import PAIRS, tp_pairs

COLLECTIVES = ("all_reduce", "all_gather", "broadcast_object")


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(__doc__, "tp", preset="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--transports", default="grpc,nixl", help="comma-separated, grpc first")
    a = p.parse_args(argv)
    transports = a.transports.split(",")
    path = model_dir(a)
    config = EngineConfig(
        ModelConfig(str(path)),
        CacheConfig(block_size=16, num_blocks=1024),
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
    )
    steps = step_profile(config, a.batch, a.steps, a.rounds)
    kv = {t: asyncio.run(kv_costs(path, a.prompt_len, a.rounds, t)) for t in transports}
    lines = header("Tensor parallelism on the CPU", "tp_bench", argv)
    lines += [
        f"- `{a.preset}` preset, float32, batch {a.batch}, {a.steps} decode steps a round, "
        f"{a.rounds} rounds; KV of one {a.prompt_len}-token prompt, {a.rounds} moves a pair.",
        "",
        "| decode step | TP 1 (2 threads) | TP 2 (1 thread a rank) |",
        "|---|---|---|",
        f"| ms per step (median of rounds) | {steps[1]['step']:.2f} | {steps[2]['step']:.2f} |",
    ]
    for name in COLLECTIVES:
        share = steps[2][name] / steps[2]["step"]
        lines.append(
            f"| {name} share of the step (with the wait for the other rank) | - | {share:.1%} |"
        )
    cols = [f"{t} µs per prompt token | {t} vs its P1 -> D1" for t in transports]
    if len(transports) > 1:
        cols += [f"{t} vs {transports[0]}" for t in transports[1:]]
    lines += [
        "",
        "| P -> D | " + " | ".join(cols) + " |",
        "|---|" + "---|" * (len(cols) + len(transports)),
    ]
    for pair in PAIRS:
        cells = [f"{kv[t][pair]:.2f} | {kv[t][pair] / kv[t][(1, 1)]:.2f}x" for t in transports]
        cells += [f"{kv[t][pair] / kv[transports[0]][pair]:.2f}x" for t in transports[1:]]
        lines.append(f"| {pair[0]} -> {pair[1]} | " + " | ".join(cells) + " |")
    return publish("\n".join(lines) + "\n", a.out)


def step_profile(config: EngineConfig, batch: int, steps: int, rounds: int) -> dict:
    """Per TP size: the median over rounds of ms per decode step, and (TP 2) of each
    collective's ms per step on the leader."""
    torch.set_num_threads(1)
    with TPReplica(config, 2) as replica:
        engines = {1: Engine(config), 2: replica.engine}
        spent = _timed(replica.engine.runner.model.tp)
        out: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
        for r in range(rounds):
            for k, engine in engines.items():
                torch.set_num_threads(2 if k == 1 else 1)
                for name in spent:
                    spent[name] = 0.0
                ms = _decode_steps(engine, batch, steps, f"{r}-{k}")
                out[k].setdefault("step", []).append(ms)
                for name, s in spent.items():
                    out[k].setdefault(name, []).append(s * 1e3 / steps)
    return {k: {n: statistics.median(v) for n, v in d.items()} for k, d in out.items()}


def _timed(group) -> dict[str, float]:
    """Wrap `group`'s collectives to add their wall time (s) into the returned dict."""
    spent = dict.fromkeys(COLLECTIVES, 0.0)
    for name in COLLECTIVES:
        inner = getattr(group, name)

        def timed(*args, _inner=inner, _name=name, **kw):
            t0 = time.perf_counter()
            try:
                return _inner(*args, **kw)
            finally:
                spent[_name] += time.perf_counter() - t0

        setattr(group, name, timed)
    return spent


def _decode_steps(engine: Engine, batch: int, steps: int, tag: str) -> float:
    """Prefill `batch` 64-token prompts, then time `steps` decode steps: ms per step."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(Request(f"{tag}-{i}", tuple(range(i, i + 64)), params))
    while any(s.num_computed_tokens < s.num_context_tokens for s in engine.seqs.values()):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    while engine.has_work():
        engine.step()
    return ms


async def kv_costs(
    path, prompt_len: int, rounds: int, transport: str = "grpc", pairs_to_time=PAIRS
) -> dict[tuple[int, int], float]:
    """Per (prefill TP, decode TP): the median µs per prompt token of moving one prompt's KV
    over `transport`."""
    with ExitStack() as stack:
        torch.set_num_threads(1)
        blocks = 4 * prompt_len // 16
        async with tp_pairs(path, stack, blocks, pairs_to_time, transport) as pairs:
            ids = tuple(i % 4000 for i in range(prompt_len))
            spent: dict[tuple[int, int], list[float]] = {pair: [] for pair in pairs_to_time}
            for r in range(rounds):
                for pair in pairs_to_time:
                    seconds = await pairs.move(pair, f"kv{r}-{pair}", ids)
                    spent[pair].append(seconds * 1e6 / prompt_len)
    return {pair: statistics.median(v) for pair, v in spent.items()}


if __name__ == "__main__":
    main()
