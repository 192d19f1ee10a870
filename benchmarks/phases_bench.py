"""Which phase dominates a request, predicted and measured: `pdserve phases` on a
decode-heavy and a prefill-heavy workload, against one disaggregated app, in one report.

    python -m benchmarks.phases_bench [--preset small] [--grpc-port PORT] [--out FILE]

Deploys 1 router + 1 prefill + 1 decode replica with one torch thread per engine (as
`pdserve serve --torch-threads 1` does) and runs `pdserve phases` (cluster/cli/bench.py)
against it for each workload below. Each run fits its phase model from probe requests sent
one at a time, predicts the workload's mean time per phase, then sends the workload and
measures it. Prompts are random, from a fixed seed per workload, so none is served from the
prefix cache.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys

from benchmarks.options import served_parser
from benchmarks.report import header, log, publish
from benchmarks.serve_session import deployed, kv_transport, measure_served
from cluster.cli.bench import add_arguments, phases_main
from cluster.config import ModelConfig
from cluster.serving.app_config import AppConfig, PoolConfig

APP = "phases"
# title -> `pdserve phases` workload options
WORKLOADS = {
    "4 prompts of 512 tokens, 64 output tokens, one at a time": [
        *("--num-requests", "4", "--input-len", "512", "--output-len", "64"),
        *("--max-concurrency", "1"),
    ],
    "4 prompts of 1,536 tokens, 4 output tokens, all at once": [
        *("--num-requests", "4", "--input-len", "1536", "--output-len", "4"),
    ],
}


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = served_parser(__doc__, "phases")
    p.add_argument("--seed", type=int, default=5, help="the first workload's prompt seed")
    a = p.parse_args(argv)
    sections, wall_s = measure_served(a, lambda model_dir, port: measure(a, model_dir, port))
    lines = [
        *header("pdserve phases: which phase dominates", "phases_bench", argv),
        f"- wall time {wall_s:.0f} s; app: 1 router + 1 prefill + 1 decode replica, one torch "
        # (the transport does not depend on the checkpoint)
        f"thread per engine, default pools otherwise; KV transport {kv_transport(app_config(''))}",
        *sections,
    ]
    return publish("\n".join(lines) + "\n", a.out)


def measure(a: argparse.Namespace, model_dir: str, grpc_port: int) -> list[str]:
    """Each workload's `pdserve phases` report, as sections of this one."""
    sections: list[str] = []
    with deployed([app_config(model_dir)]):
        for i, (title, options) in enumerate(WORKLOADS.items()):
            log(f"pdserve phases: {title}")
            target = ["--target", f"127.0.0.1:{grpc_port}", "--application", APP]
            # A seed per workload: prompts of one seed start alike, and would hit the cache.
            report = _phases([*target, *options, "--seed", str(a.seed + 1000 * i)])
            body = report.splitlines()[2:]  # its own "# pdserve phases" title off
            sections += ["", f"## {title}", "", *body]
    return sections


def app_config(model_dir: str) -> AppConfig:
    pool = PoolConfig(torch_threads=1)
    return AppConfig(model=ModelConfig(path=model_dir), prefill=pool, decode=pool, name=APP)


def _phases(options: list[str]) -> str:
    """`pdserve phases OPTIONS`'s Markdown report."""
    p = argparse.ArgumentParser()
    add_arguments(p, slo=False)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = phases_main(p.parse_args(options))
    if status:
        raise SystemExit(f"pdserve phases {' '.join(options)}: no request completed")
    return out.getvalue()


if __name__ == "__main__":
    main()
