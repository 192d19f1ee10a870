"""What prefix caching saves: time to first token of prompts that share a long prefix.

    python -m benchmarks.prefix_bench [--preset small] [--prefix 512] [--out FILE]

One engine with prefix caching and one without, same checkpoint and config, in this process.
Each gets the same sequence of requests, one at a time: `--requests` prompts made of one shared
prefix (a system prompt, a few-shot preamble, an earlier chat turn) plus a distinct suffix,
generating one token each. Prints the median time to first token of the requests after the
first (which fills the cache), the prompt tokens each computed, and the ratio; then checks that
both engines produced the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from benchmarks.options import common_parser, model_dir, with_threads
from benchmarks.report import header, publish
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.request import Request
from cluster.sampling_params import SamplingParams


def run(engine: Engine, prompts: list[list[int]]) -> tuple[list[float], list[int], list[int]]:
    """Per request: seconds to its first token, cached prompt tokens, and that token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttft, cached, firsts = [], [], []
    for i, ids in enumerate(prompts):
        t = time.perf_counter()
        (out,) = engine.generate([Request(f"q{i}-{t}", tuple(ids), params)])
        ttft.append(time.perf_counter() - t)
        cached.append(out.num_cached_tokens)
        firsts.append(out.token_ids[0])
    assert engine.scheduler.blocks.num_used == 0, "KV blocks leaked"
    return ttft, cached, firsts


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common_parser(__doc__, "prefix")
    p.add_argument("--prefix", type=int, default=512, help="shared prefix tokens")
    p.add_argument("--suffix", type=int, default=32, help="distinct tokens per request")
    p.add_argument("--requests", type=int, default=6)
    a = p.parse_args(argv)
    return publish(with_threads(a.threads, lambda: measure(a, argv)), a.out)


def measure(a: argparse.Namespace, argv: list[str]) -> str:
    path = model_dir(a)
    rng = random.Random(0)
    shared = [rng.randrange(16, 1000) for _ in range(a.prefix)]
    prompts = [
        shared + [rng.randrange(16, 1000) for _ in range(a.suffix)] for _ in range(a.requests)
    ]
    length = a.prefix + a.suffix
    results = {}
    for caching in (True, False):
        engine = Engine(
            EngineConfig(
                ModelConfig(str(path)),
                CacheConfig(num_blocks=-(-length // 16) * 2 + 8, enable_prefix_caching=caching),
                SchedulerConfig(max_num_batched_tokens=max(512, length)),
            )
        )
        run(engine, prompts[:1])  # warm-up, with a prompt of its own prefix
        engine = Engine(engine.config, engine.loaded)  # an empty cache, the same weights
        results[caching] = run(engine, prompts)
    on, off = results[True], results[False]
    med_on, med_off = (statistics.median(r[0][1:]) * 1e3 for r in (on, off))
    lines = [
        *header("Prefix caching: time to first token with a shared prefix", "prefix_bench", argv),
        f"- {torch.get_num_threads()} torch thread(s)",
        f"- model: `{a.preset}` preset, fp32 on the CPU; {a.requests} requests in turn, each "
        f"{a.prefix} shared + {a.suffix} own prompt tokens, 1 output token; block size 16",
        "",
        "| | caching on | caching off | on / off |",
        "|---|---|---|---|",
        f"| first request TTFT (ms) | {on[0][0] * 1e3:.1f} | {off[0][0] * 1e3:.1f} | "
        f"{on[0][0] / off[0][0]:.2f} |",
        f"| later requests, median TTFT (ms) | {med_on:.1f} | {med_off:.1f} | "
        f"{med_on / med_off:.2f} |",
        f"| later requests, cached prompt tokens | {on[1][1]} | {off[1][1]} | |",
        "",
        f"Same first tokens with and without caching: {'yes' if on[2] == off[2] else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
