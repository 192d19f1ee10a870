"""Capacity of the serving path: N concurrent gRPC streams on the tiny model through a deployed
app (1 router, 1 prefill and 1 decode replica), against the engine alone.

    python -m benchmarks.capacity_bench [--streams 1,16,64,256] [--tokens 256]
        [--prompt-tokens 16] [--paths proxy,direct] [--repeats 3]
        [--engine-cpus LIST | --decode-engine-cpus LIST] [--before REV] [--out FILE]

For each N, all N streams (greedy, `ignore_eos`, `--tokens` each, prompts of their own) are
sent at once over one channel, by each path in turn: through Serve's gRPC proxy ("proxy"), and
straight to the router replica's own gRPC endpoint ("direct", router/grpc_endpoint.py), then
the same requests go through `Engine.generate` in this process (one engine of the decode
pool's config and torch threads: the engine alone). Per N and path it reports the tokens the
clients received per second and that over the engine alone's; the CPU time each process spent
per delivered token, from /proc (Serve's proxy, the router, the decode and the prefill replica,
and the load client, a process of its own on uvloop); tokens per message (the path coalesces
streams that fall behind); and the time to first token (TTFT) and inter-token latency (ITL)
p50 / p99 as the client saw them (`benchmarks/stream_load.py`). Each process's CPU while the
app sat idle is shown apart; the figures count all of it. All of that runs `--repeats` times in
turn on the one deployed app, the engine alone around each round, and each (N, path) shows its
run of median delivered / engine alone beside every run's ratio: on a shared 2-core machine one
run's ratio moves by ±0.04.

Targets (issue 21), at N = 64: proxy + router at most 100 µs of CPU per delivered token, and
delivered tok/s at least 0.8x the engine alone; both are checked for each path. With
`--before REV` it first measures N = 1 through the proxy and N = 64 direct on the code at REV
(`benchmarks/capacity_before.py`) and prints those figures beside this tree's.

It starts a local Ray and Serve of its own (needed for the CPU figures: it finds the processes
among its raylet's workers) and shuts them down after; `--grpc-port` uses a running one (the
session's, in the tests). The report goes to benchmarks/results/capacity.md
(`benchmarks/capacity_report.py`).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from benchmarks.capacity_before import measure_before, write_json
from benchmarks.capacity_report import PATHS, AloneRun, Point, render
from benchmarks.grpc_calls import stub, wait_ready
from benchmarks.options import checkpoint_options, model_dir, with_threads
from benchmarks.paced_engine import PACED_DECODE, STEP_ENV, pace
from benchmarks.proc_stats import cpu_seconds, serving_processes
from benchmarks.report import log, publish
from benchmarks.serve_session import deployed, kv_transport, on_serve
from benchmarks.stream_load import LoadClient, LoadResult, greedy_request, run_load
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.model.info import describe_model
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.cpu_affinity import cpu_list_arg, reserve_for_engines

APP = "capacity"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    checkpoint_options(p, "capacity", preset="tiny")
    p.add_argument("--streams", default="1,16,64,256", help="N values, comma-separated")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens per stream")
    p.add_argument("--paths", default=",".join(PATHS), help="proxy, direct or both")
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="K",
        help="K > 1: also run every N and path with GenerateRequest.stream_interval K "
        "(tokens per message after the first), reported beside the default stream",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        metavar="K",
        help="run every N by every path K times in turn, the engine alone around each round; "
        "the report shows each point's run of median delivered / engine alone, and every "
        "run's ratio",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--idle-seconds", type=float, default=3.0, help="idle CPU window")
    p.add_argument(
        "--engine-cpus",
        type=cpu_list_arg,
        default=(),
        metavar="LIST",
        help="cores of the engine threads (both pools' and the engine alone's); Ray, its "
        "proxy, the router and the load client then run on the others (default: no pinning)",
    )
    p.add_argument(
        "--decode-engine-cpus",
        type=cpu_list_arg,
        default=(),
        metavar="LIST",
        help="cores of the decode pool's engine thread (and the engine alone's), nothing "
        "reserved: every other thread still runs anywhere (the decode pool's engine_cpus)",
    )
    p.add_argument(
        "--before",
        metavar="REV",
        default=None,
        help="also measure N = 1 through the proxy and N = 64 direct on the code at git "
        "revision REV (e.g. HEAD), in a child process with a Ray of its own, and print both",
    )
    p.add_argument("--json", default=None, help="also write the key figures here, as JSON")
    p.add_argument(
        "--gpu-step-ms",
        type=float,
        default=0.0,
        help="also run every N on an emulated GPU engine: the decode pool's forward pass "
        "replaced by a sleep of this many ms per step (benchmarks/paced_engine.py); 0: not",
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=0,
        help="use the Serve already running in this process's Ray, its gRPC proxy on this port",
    )
    a = p.parse_args(argv)
    a.stream_counts = [int(x) for x in a.streams.split(",") if x]
    a.path_names = [x for x in a.paths.split(",") if x]
    a.intervals = [1] if a.stream_interval <= 1 else [1, a.stream_interval]
    if not a.stream_counts or not set(a.path_names) <= set(PATHS) or not a.path_names:
        p.error(f"--streams needs N values and --paths some of {', '.join(PATHS)}")
    if a.repeats < 1:
        p.error("--repeats needs at least 1")
    if a.engine_cpus and a.decode_engine_cpus:
        p.error("--engine-cpus pins both pools' engines: leave --decode-engine-cpus out")
    if (a.engine_cpus or a.gpu_step_ms) and a.grpc_port:
        p.error("--engine-cpus and --gpu-step-ms need a Ray this script starts")
    return a


def app_config(checkpoint: str, a: argparse.Namespace) -> AppConfig:
    """1 router, 1 prefill and 1 decode replica, each engine pool able to hold every stream."""
    most = max(a.stream_counts)
    per_stream = -(-(a.prompt_tokens + a.tokens) // 16) + 1
    pool = PoolConfig(
        num_cpus=0.25,
        torch_threads=a.threads,
        engine_cpus=a.engine_cpus,
        cache=CacheConfig(block_size=16, num_blocks=most * per_stream + 64),
        scheduler=SchedulerConfig(max_num_seqs=max(most, 8), max_num_batched_tokens=512),
    )
    return AppConfig(
        model=ModelConfig(path=checkpoint),
        router=replace(pool, engine_cpus=(), max_ongoing_requests=max(4 * most, 64)),
        prefill=pool,
        decode=replace(pool, engine_cpus=a.engine_cpus or a.decode_engine_cpus),
        default_max_tokens=a.tokens,
        name=APP,
    )


def prompts(n: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    rng = random.Random(salt)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


class EngineAlone:
    """An engine of the decode pool's config on a thread of its own (on the engine cores);
    with `step_s`, paced as the emulated GPU engine (`paced_engine`)."""

    def __init__(self, app: AppConfig, cpus: tuple[int, ...], step_s: float = 0.0) -> None:
        self.pool = ThreadPoolExecutor(1, initializer=_pin, initargs=(cpus,))
        self.engine = self.pool.submit(Engine, app.engine_config("colocated")).result()
        if step_s:
            pace(self.engine, step_s)

    def run(self, batch: list[list[int]], tokens: int) -> AloneRun:
        """The batch, all queued at once, stepped to the end as `Engine.generate` does."""
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        requests = [Request(f"alone-{i}", tuple(p), params) for i, p in enumerate(batch)]
        return self.pool.submit(_step_through, self.engine, requests).result()

    def close(self) -> None:
        self.pool.shutdown()


def _step_through(engine: Engine, requests: list[Request]) -> AloneRun:
    """The ramp as the served load's (`LoadResult.all_decoding_s`): until every request has
    its second token, the first one decoded."""
    waiting = {r.request_id for r in requests}
    began = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    ramp, steps, tokens = math.nan, [], 0
    while engine.has_work():
        t = time.perf_counter()
        outs = engine.step()
        if waiting:
            waiting.difference_update(o.request_id for o in outs if o.num_output_tokens >= 2)
            ramp = time.perf_counter() - began
        else:
            steps.append(time.perf_counter() - t)
        tokens += sum(len(o.token_ids) for o in outs)
    wall = time.perf_counter() - began
    return AloneRun(tokens / wall, ramp, float(np.median(steps)) if steps else math.nan)


def _pin(cpus: tuple[int, ...]) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def served(
    target: str, pids: dict[str, int], batch: list[list[int]], tokens: int, interval: int = 1
) -> tuple[LoadResult, dict[str, float]]:
    """The load through `target` (at `interval` tokens per message), and each process's CPU
    seconds meanwhile (the load client's own process as "client")."""
    with LoadClient(target, APP, [greedy_request(p, tokens, interval) for p in batch]) as client:
        before = cpu_seconds(pids)
        client.go()
        after = cpu_seconds(pids)
        load = client.result()
    cpu = {name: after[name] - before[name] for name in after if name in before}
    cpu["client"] = load.client_cpu_s
    return load, cpu


def idle_rates(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """CPU seconds per second of each process while the app serves nothing."""
    before = cpu_seconds(pids)
    time.sleep(seconds)
    after = cpu_seconds(pids)
    return {name: (after[name] - before[name]) / seconds for name in after if name in before}


def targets(grpc_port: int, paths: list[str]) -> dict[str, str]:
    """Path -> the address its streams go to: Serve's proxy, the router's own endpoint."""
    from ray import serve

    to = {"proxy": f"127.0.0.1:{grpc_port}"}
    if "direct" in paths:
        router = serve.get_deployment_handle("Router", app_name=APP)
        to["direct"] = router.grpc_endpoint.remote().result()
    return to


def measure(grpc_port: int, a: argparse.Namespace, checkpoint: str):
    """Every N by every path, on the tiny model and (`--gpu-step-ms`) on the paced engine."""
    points, idle, transport = measure_engine(grpc_port, a, checkpoint, "model")
    if a.gpu_step_ms:
        points += measure_engine(grpc_port, a, checkpoint, "paced")[0]
    return points, idle, transport


def measure_engine(grpc_port: int, a: argparse.Namespace, checkpoint: str, engine_kind: str):
    """One app whose decode pool runs `engine_kind` ("model", or "paced": `paced_engine`):
    each N through each path, and the engine alone (before and after, averaged)."""
    app = app_config(checkpoint, a)
    vocab = describe_model(app.model).spec.vocab_size
    roles = {"Decode": PACED_DECODE} if engine_kind == "paced" else None
    with deployed([app], roles):
        wait_ready(stub(grpc_port), APP, prompts(1, a.prompt_tokens, vocab, 0)[0])
        found = serving_processes({APP: APP})
        pids = {name.split("/")[-1]: pid for name, pid in found.items()}
        log(f"processes: {pids}")
        to = targets(grpc_port, a.path_names)
        for path in a.path_names:  # warm both paths up
            run_load(to[path], APP, [greedy_request(p, 16) for p in prompts(4, 16, vocab, 1)])
        idle = idle_rates(pids, a.idle_seconds) if pids else {}
        step_s = a.gpu_step_ms / 1e3 if engine_kind == "paced" else 0.0
        engine = EngineAlone(app, app.decode.engine_cpus, step_s)
        points = []
        for k, n in enumerate(a.stream_counts):
            batch = prompts(n, a.prompt_tokens, vocab, 100 + k)
            runs = [one_round(engine, to, pids, batch, a, engine_kind) for _ in range(a.repeats)]
            points += [median_run([r[key] for r in runs]) for key in runs[0]]
        engine.close()
        return points, idle, kv_transport(app)


def one_round(engine: EngineAlone, to: dict[str, str], pids, batch, a, engine_kind: str):
    """One round: the batch by every path and interval, the engine alone before and after
    (averaged); (path, interval) -> Point."""
    n = len(batch)
    alone = engine.run(batch, a.tokens)
    runs = {}
    for path in a.path_names:
        for interval in a.intervals:
            runs[path, interval] = served(to[path], pids, batch, a.tokens, interval)
            tok_s = runs[path, interval][0].tok_per_s
            log(f"{engine_kind} N={n} {path}/{interval}: {tok_s:.0f} tok/s")
    alone = alone.mean(engine.run(batch, a.tokens))
    log(f"{engine_kind} N={n}: {alone.tok_per_s:.0f} tok/s alone")
    return {
        key: Point(n, key[0], load, alone, cpu, engine_kind, key[1])
        for key, (load, cpu) in runs.items()
    }


def median_run(points: list[Point]) -> Point:
    """The run of median delivered / engine alone (the lower middle of an even count), with
    every run's ratio, in the order they ran."""
    chosen = sorted(points, key=lambda p: p.ratio)[(len(points) - 1) // 2]
    return replace(chosen, ratios=tuple(p.ratio for p in points))


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    checkpoint = str(model_dir(a))
    began = time.perf_counter()
    before = measure_before(a.before, a) if a.before else None
    if a.engine_cpus:  # Ray's processes inherit the other cores
        reserve_for_engines(a.engine_cpus)
    if a.gpu_step_ms:  # and this environment: the paced replicas read their step time here
        os.environ[STEP_ENV] = str(a.gpu_step_ms / 1e3)
    points, idle, transport = with_threads(
        a.threads, lambda: on_serve(a.grpc_port, lambda port: measure(port, a, checkpoint))
    )
    if a.json:
        write_json(points, a.json)
    report = render(a, argv, points, idle, transport, time.perf_counter() - began, before)
    return publish(report, a.out)


if __name__ == "__main__":
    main()
