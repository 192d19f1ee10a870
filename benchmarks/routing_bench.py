"""What prefix-affinity routing saves: 2 prefill replicas serving prompts that share prefixes,
with pdserve's routing and with Serve's default, side by side in one run.

    python -m benchmarks.routing_bench [--preset small] [--tenants 12] [--prefix 256]
        [--rounds 4] [--num-blocks 176] [--clients 1] [--routers 1] [--out FILE]

Two apps on one local Ray, the same config (2 prefill replicas, 1 decode replica, one torch
thread each), one with `prefix_affinity` on (the default) and one with it off (Serve's power
of two choices). `--tenants` prefixes (a system prompt or few-shot preamble each) are sent in
turn, `--rounds` times, each time with a suffix of its own, through the gRPC API, alternating
between the two apps (which goes first swaps every request), one request at a time or, with
`--clients N`, from N client threads that take the requests in that order. Each
prefill replica's KV pool holds `--num-blocks` blocks: by default fewer than all the prefixes
need, more than half of them, as when a pool serves more prefixes than one replica can keep.
Prints per app the share of prompt tokens served from the prefix cache, how many repeats found
their whole prefix cached, the median time to first token of the first round and of the
repeats, and how the requests spread over the replicas; then checks that both apps gave the
same tokens and that no KV blocks are left in use.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.grpc_calls import Stream, served_generate, stub, used_blocks, wait_ready
from benchmarks.options import served_parser
from benchmarks.report import header, log, publish
from benchmarks.serve_session import deployed, measure_served, small_pool
from cluster.config import ModelConfig
from cluster.serving.app_config import AppConfig, PoolConfig

APPS = {"prefix affinity": "route-affinity", "Serve's default (power of two)": "route-pow2"}
OUTPUT_TOKENS = 2  # the first from prefill, one from decode: the whole path, short


@dataclass
class Served:
    """One app's requests, in order."""

    ttft_s: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    replica: list[str] = field(default_factory=list)
    tenant: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    used_blocks_after: int = -1

    def add(self, tenant: int, s: Stream) -> None:
        self.ttft_s.append(s.token_times[0] - s.call_at)
        self.cached.append(s.last.usage.cached_prompt_tokens)
        self.prompt_tokens.append(s.last.usage.prompt_tokens)
        self.replica.append(s.last.timing.prefill_replica)
        self.tenant.append(tenant)
        self.tokens.append(s.token_ids)


def app_config(a: argparse.Namespace, model_dir: str, affinity: bool, name: str) -> AppConfig:
    pool = small_pool(a.num_blocks, max_num_seqs=8)
    return AppConfig(
        model=ModelConfig(path=model_dir),
        router=replace(pool, num_cpus=0.25, replicas=a.routers),
        prefill=replace(
            pool, replicas=2, prefix_affinity=affinity, affinity_max_imbalance=a.max_imbalance
        ),
        decode=pool,
        name=name,
    )


def prompts(a: argparse.Namespace, vocab: int) -> list[tuple[int, list[int]]]:
    """(tenant, prompt) in sending order: every tenant's prefix once per round."""
    rng = random.Random(a.seed)
    # Skip the low ids, where make_model's tokenizers keep their special tokens.
    prefixes = [[rng.randrange(16, vocab) for _ in range(a.prefix)] for _ in range(a.tenants)]
    return [
        (t, prefixes[t] + [rng.randrange(16, vocab) for _ in range(a.suffix)])
        for _ in range(a.rounds)
        for t in range(a.tenants)
    ]


def measure(a: argparse.Namespace, model_dir: str, grpc_port: int) -> dict[str, Served]:
    proxy = stub(grpc_port)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    results = {label: Served() for label in APPS}
    configs = [app_config(a, model_dir, label == "prefix affinity", n) for label, n in APPS.items()]
    with deployed(configs):
        warm = random.Random(a.seed + 1)
        for name in APPS.values():  # every replica's first-call costs, outside the numbers
            wait_ready(proxy, name, [warm.randrange(16, vocab) for _ in range(a.prefix)])
            for _ in range(6):
                prompt = [warm.randrange(16, vocab) for _ in range(a.prefix + a.suffix)]
                served_generate(proxy, name, prompt, OUTPUT_TOKENS)
        work = prompts(a, vocab)
        # Request i of each app in the order (A, B) or (B, A), alternating; `--clients` threads
        # take them in that order, so each app has about half of them in flight.
        calls = [
            (label, name, tenant, prompt)
            for i, (tenant, prompt) in enumerate(work)
            for label, name in list(APPS.items())[:: 1 if i % 2 else -1]
        ]
        with ThreadPoolExecutor(a.clients) as clients:
            streams = clients.map(
                lambda c: served_generate(proxy, c[1], c[3], OUTPUT_TOKENS), calls
            )
            for k, ((label, _, tenant, _), s) in enumerate(zip(calls, streams, strict=True)):
                results[label].add(tenant, s)
                if k % 2:
                    log(
                        f"request {k // 2 + 1} of {len(work)}: tenant {tenant}, "
                        + ", ".join(f"{lb} cached {r.cached[-1]}" for lb, r in results.items())
                    )
        for label, name in APPS.items():
            results[label].used_blocks_after = used_blocks(proxy, name)
    return results


def render(a: argparse.Namespace, argv: list[str], res: dict[str, Served], wall_s: float) -> str:
    first = a.tenants  # requests of the first round
    full = (a.prefix // 16) * 16  # a prefix's tokens in full blocks
    lines = [
        *header("pdserve prefix-affinity routing benchmark", "routing_bench", argv),
        f"- wall time {wall_s:.0f} s",
        f"- workload: {a.tenants} prefixes of {a.prefix} tokens, each + {a.suffix} tokens of "
        f"its own, {a.rounds} rounds, {_clients(a.clients)}, {OUTPUT_TOKENS} output tokens; "
        f"2 prefill replicas with {a.num_blocks} KV blocks of 16 tokens each "
        f"({a.num_blocks * 16 // a.prefix} prefixes' worth), 1 decode replica, "
        f"{a.routers} router replica(s), per app; affinity_max_imbalance {a.max_imbalance}",
        "",
        "| | " + " | ".join(res) + " |",
        "|---|" + "---|" * len(res),
    ]

    def row(name: str, cell) -> None:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in res.values()) + " |")

    row(
        "prompt tokens from the prefix cache, all rounds",
        lambda r: f"{sum(r.cached) / sum(r.prompt_tokens):.1%}",
    )
    row(
        f"repeats (rounds 2-{a.rounds}) with their whole prefix cached",
        lambda r: f"{sum(c >= full for c in r.cached[first:])} / {len(r.cached) - first}",
    )
    row("median TTFT, round 1 (ms)", lambda r: f"{statistics.median(r.ttft_s[:first]) * 1e3:.0f}")
    row(
        f"median TTFT, rounds 2-{a.rounds} (ms)",
        lambda r: f"{statistics.median(r.ttft_s[first:]) * 1e3:.0f}",
    )
    row(
        f"mean TTFT, rounds 2-{a.rounds} (ms)",
        lambda r: f"{statistics.mean(r.ttft_s[first:]) * 1e3:.0f}",
    )
    row(
        "prompt tokens computed, all rounds",
        lambda r: str(sum(r.prompt_tokens) - sum(r.cached)),
    )
    row(
        "requests per prefill replica",
        lambda r: " / ".join(str(n) for _, n in sorted(Counter(r.replica).items())),
    )
    row(
        "prefixes served by more than one replica",
        lambda r: str(
            sum(
                len({rep for rep, t in zip(r.replica, r.tenant, strict=True) if t == k}) > 1
                for k in range(a.tenants)
            )
        ),
    )
    row("KV blocks used or leased after the run", lambda r: str(r.used_blocks_after))
    a_res, b_res = res.values()
    ratio = statistics.mean(a_res.ttft_s[first:]) / statistics.mean(b_res.ttft_s[first:])
    same = all(x == y for x, y in zip(a_res.tokens, b_res.tokens, strict=True))
    lines += [
        "",
        f"Mean TTFT of the repeats, prefix affinity / Serve's default: {ratio:.2f}x. "
        f"Same tokens from both apps for every prompt: {'yes' if same else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


def _clients(n: int) -> str:
    return "one request at a time" if n == 1 else f"{n} clients over both apps"


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = served_parser(__doc__, "routing")
    p.add_argument("--tenants", type=int, default=12, help="distinct shared prefixes")
    p.add_argument("--prefix", type=int, default=256, help="tokens of each shared prefix")
    p.add_argument("--suffix", type=int, default=16, help="tokens of each request's own")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-blocks", type=int, default=176, help="KV blocks per replica")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-imbalance",
        type=int,
        default=PoolConfig().affinity_max_imbalance,
        help="the affinity app's affinity_max_imbalance (default: pdserve's)",
    )
    p.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router replicas per app (each routes by what it sent itself)",
    )
    p.add_argument(
        "--clients",
        type=int,
        default=1,
        help="client threads taking the requests in order "
        "(both apps' together; default: one request at a time)",
    )
    a = p.parse_args(argv)
    res, wall_s = measure_served(a, lambda model_dir, port: measure(a, model_dir, port))
    return publish(render(a, argv, res, wall_s), a.out)


if __name__ == "__main__":
    main()
