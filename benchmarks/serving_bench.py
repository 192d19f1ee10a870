"""What serving through Ray Serve costs on top of the engine, and what moving the KV costs.

    python -m benchmarks.serving_bench [--quick] [--repeats N] [--no-colocated]
        [--engine-cpus LIST] [--grpc-port PORT] [--out FILE]

On one checkpoint (`small` by default, `tiny` with `--quick`), fp32 on CPU (or `--device cuda
--dtype bfloat16`: every engine replica and the baseline on GPU 0), one run prints:

1. decode time per output token of a batch-1 greedy `ignore_eos` generation with a short
   prompt: in this process (`Engine.step()` loop, same engine config, torch threads, CPU
   priority and, with `--engine-cpus`, cores as the replicas), on the decoding replica's own
   engine alone, and through the deployed app over Serve's gRPC proxy (client-side, from the
   arrival times of the streamed messages), disaggregated and colocated. All count the steps
   after the second output token, so neither the prefill nor the KV transfer is in the
   number. Runs are interleaved (in-process and each app, the order rotated every repeat) so
   a change in machine load hits all alike and none always runs right after another. The
   added latency is the median of the paired differences. The CPU time each process spends
   per output token (read from /proc) shows where the serving path's time goes.
2. KV transfer throughput on loopback: `GrpcKVClient.fetch` from this process of a prompt's KV
   held by the real prefill replica (via the `Prefill` deployment's handle), bytes being the
   assembled K and V tensors' `nbytes`.
3. KV transfer as a share of TTFT, from the `timing` of the final `GenerateResponse`.

With `--engine-cpus LIST` the engine threads (every replica's and the baseline's) run only on
those cores and everything else (Ray's processes, the proxies, the router, this client) only on
the others, as `pdserve serve --engine-cpus` deploys a CPU node.

Without `--grpc-port` it starts its own local Ray and Serve and shuts them down at the end;
with it, it uses the Serve already running in this process's Ray (e.g. a test session's) and
only deploys and deletes its own apps. The decoding replicas are the production classes with
timing probes added (`benchmarks/probed_replicas.py`). The options and apps are in
`serving_config`, the measurements in `serving_runs`, the report in `serving_report`; it goes
to `benchmarks/results/serving.md` by default.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch

from benchmarks.grpc_calls import stub as grpc_stub
from benchmarks.probed_replicas import PROBED_ROLES
from benchmarks.proc_stats import niceness, node_env, serving_processes
from benchmarks.report import publish
from benchmarks.serve_session import deployed, local_serve
from benchmarks.serving_config import MODES, ServingBenchConfig, app_configs, parse_args
from benchmarks.serving_report import render
from benchmarks.serving_results import Results
from benchmarks.serving_runs import Baseline, DecodeRuns, kv_fetches, ttft_runs
from cluster.serving.cpu_affinity import reserve_for_engines

# App name -> mode, to find each replica's process.
APP_MODES = {name: mode for mode, name in MODES.items()}


def run(grpc_port: int, cfg: ServingBenchConfig) -> Results:
    """Deploy the benchmark's apps on the running Serve, measure, delete them again."""
    configs = [app_configs(cfg)[m] for m in cfg.modes]
    started = datetime.datetime.now().astimezone().isoformat("T", "seconds")
    res = Results(cfg, configs[0], started=started, load_before=os.getloadavg())
    began = time.perf_counter()
    old_threads = torch.get_num_threads()
    baseline: Baseline | None = None
    try:
        with deployed(configs, PROBED_ROLES):
            procs = _processes(res)
            if cfg.torch_threads:
                torch.set_num_threads(cfg.torch_threads)
            nice = res.niceness.get("disaggregated/Decode")
            baseline = Baseline(res.app, nice, cfg.engine_cpus)
            res.niceness["in-process baseline"] = baseline.niceness
            runs = DecodeRuns(cfg, res, baseline, grpc_stub(grpc_port))
            runs.measure(cfg.modes, procs)
            res.fetch = kv_fetches(cfg, res.app, baseline.engine)
            res.ttft = ttft_runs(cfg, runs.stub, baseline.engine)
    finally:
        if baseline is not None:
            baseline.close()
        torch.set_num_threads(old_threads)
    res.load_after = os.getloadavg()
    res.elapsed_s = time.perf_counter() - began
    return res


def _processes(res: Results) -> dict[str, int]:
    """The serving processes of our Ray; their nice values and the proxy's node env go into
    `res`."""
    procs = serving_processes(APP_MODES)
    res.niceness = {k: v for k, pid in procs.items() if (v := niceness(pid)) is not None}
    res.proxy_env = node_env(procs["proxy"]) if "proxy" in procs else None
    return procs


def main(argv: list[str] | None = None) -> str:
    """Run the benchmark; print the Markdown report, write it to `--out` and return it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, cfg = parse_args(argv, __doc__)
    if args.grpc_port:
        res = run(args.grpc_port, cfg)
    else:
        # Read by the raylet this starts (it inherits our environment), so ours only.
        os.environ["RAY_worker_niceness"] = str(cfg.worker_niceness)
        if cfg.engine_cpus:  # Ray's processes inherit the rest; the engine threads move back
            reserve_for_engines(cfg.engine_cpus)
        with local_serve() as grpc_port:
            res = run(grpc_port, cfg)
    return publish(render(res, argv), args.out)


if __name__ == "__main__":
    main()
