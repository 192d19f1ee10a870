"""Serving-path capacity: N concurrent gRPC streams through a deployed app (1 router, 1 prefill,
1 decode replica) by Serve's proxy and by the router's own endpoint, against the same requests
on the engine alone.

    python -m benchmarks.serving_bench [--streams 1,64] [--tokens 256] [--paths proxy,direct]
        [--stream-interval K] [--repeats 3] [--decode-engine-cpus LIST]
        [--device cuda --dtype bfloat16] [--preset tiny | --model-dir DIR] [--threads T]

Each N sends its streams (greedy, `ignore_eos`, prompts of their own) all at once from a client
process of its own (`stream_load`), by each path in turn (`--stream-interval K`: also at K
tokens a message); around each round an engine of the decode pool's config runs them in this
process (the engine alone). Per N and path: delivered tok/s over the engine alone's (the run of
median ratio, and every run's), tokens per message, each process's CPU per token (/proc), TTFT,
ITL and the burst's ramp. Targets: at N = 64, proxy + router at most 100 µs of CPU per token and
delivered at least 0.8x the engine alone; at N = 1, the latency serving adds per token (served
ITL p50 minus the engine alone's step, paired by round) at most 1 ms over the whole confidence
interval. Last, the gRPC reference rows (`grpc_reference`). It starts a Ray and Serve of its
own (the CPU figures need its raylet's processes); `--grpc-port` uses a running one.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, replace

from benchmarks import report
from benchmarks.grpc_reference import reference_rows
from benchmarks.proc_stats import cpu_seconds, serving_processes
from benchmarks.serve_session import deployed, kv_transport, on_serve, stub, wait_ready
from benchmarks.stream_load import LoadClient, LoadResult, greedy_request, run_load
from cluster.config import CacheConfig, ModelConfig, SchedulerConfig
from cluster.engine.engine import Engine
from cluster.model.info import describe_model
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig, PoolConfig
from cluster.serving.cpu_affinity import cpu_list_arg

APP = "serving"
PATHS = ("proxy", "direct")
PROCESSES = ("proxy", "Router", "Prefill", "Decode", "client")
TARGET_PATH_US, TARGET_RATIO, TARGET_ADDED_MS = 100.0, 0.8, 1.0
PROMPT = 16  # tokens a prompt


def parse_args(argv: list[str]):
    p = report.served_parser(__doc__, "serving", preset="tiny")
    report.add_threads_option(p)
    p.set_defaults(threads=1)  # as each replica's engine
    p.add_argument("--streams", default="1,64", help="N values, comma-separated")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per stream")
    p.add_argument("--paths", default=",".join(PATHS), help="proxy, direct or both")
    p.add_argument("--stream-interval", type=int, default=1, metavar="K", help="also at K > 1")
    p.add_argument("--repeats", type=int, default=3, help="rounds per N (pairs at N = 1)")
    p.add_argument(
        "--decode-engine-cpus",
        type=cpu_list_arg,
        default=(),
        metavar="LIST",
        help="cores of the decode engine thread and the engine alone's (nothing reserved)",
    )
    p.add_argument("--device", default="cpu", help="the engines' device")
    p.add_argument("--dtype", default="float32", help="the engines' dtype")
    a = p.parse_args(argv)
    a.stream_counts = [int(x) for x in a.streams.split(",") if x]
    a.path_names = [x for x in a.paths.split(",") if x]
    a.intervals = [1] if a.stream_interval <= 1 else [1, a.stream_interval]
    if not (a.stream_counts and a.path_names and set(a.path_names) <= set(PATHS)) or a.repeats < 1:
        p.error(f"need N values, --paths of {', '.join(PATHS)} and --repeats >= 1")
    return a


def app_config(checkpoint: str, a) -> AppConfig:
    """1 router, 1 prefill and 1 decode replica, each engine pool able to hold every stream."""
    most = max(a.stream_counts)
    per_stream = -(-(PROMPT + a.tokens) // 16) + 1
    pool = PoolConfig(
        num_cpus=0.25,
        num_gpus=0.4 if a.device.startswith("cuda") else 0,
        torch_threads=a.threads,
        cache=CacheConfig(block_size=16, num_blocks=most * per_stream + 64),
        scheduler=SchedulerConfig(max_num_seqs=max(most, 8), max_num_batched_tokens=512),
    )
    return AppConfig(
        model=ModelConfig(path=checkpoint, device=a.device, dtype=a.dtype),
        router=replace(pool, num_gpus=0, max_ongoing_requests=max(4 * most, 64)),
        prefill=pool,
        decode=replace(pool, engine_cpus=a.decode_engine_cpus),
        default_max_tokens=a.tokens,
        name=APP,
    )


def prompts(n: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    rng = random.Random(salt)
    return [[rng.randrange(16, vocab) for _ in range(length)] for _ in range(n)]


@dataclass(frozen=True)
class AloneRun:
    """The engine alone on one batch: tok/s, the time until every request had its second
    token (the burst's ramp), and the median step after that."""

    tok_per_s: float
    ramp_s: float
    step_s: float

    def mean(self, o: AloneRun) -> AloneRun:
        return AloneRun(*((x + y) / 2 for x, y in zip(astuple(self), astuple(o), strict=True)))


class EngineAlone:
    """An engine of the decode pool's config on a thread of its own (on the decode cores)."""

    def __init__(self, app: AppConfig) -> None:
        cpus = app.decode.engine_cpus
        self.pool = ThreadPoolExecutor(
            1, initializer=lambda: cpus and os.sched_setaffinity(0, cpus)
        )
        self.engine = self.pool.submit(Engine, app.engine_config("colocated")).result()

    def run(self, batch: list[list[int]], tokens: int) -> AloneRun:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        requests = [Request(f"alone-{i}", tuple(p), params) for i, p in enumerate(batch)]
        return self.pool.submit(self._step_through, requests).result()

    def _step_through(self, requests: list[Request]) -> AloneRun:
        engine, waiting = self.engine, {r.request_id for r in requests}
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
        step = statistics.median(steps) if steps else math.nan
        return AloneRun(tokens / (time.perf_counter() - began), ramp, step)


@dataclass(frozen=True)
class Point:
    """One N by one path and interval: the served load, the engine alone on the same requests,
    each process's CPU seconds during the served run, and every run's ratio."""

    streams: int
    path: str
    interval: int
    load: LoadResult
    alone: AloneRun
    cpu_s: dict[str, float]
    ratios: tuple[float, ...] = ()
    added_s: tuple[float, ...] = ()  # served ITL p50 minus the engine alone's step, per run

    def us_per_token(self, process: str) -> float:
        return 1e6 * self.cpu_s.get(process, math.nan) / self.load.tokens

    @property
    def path_us(self) -> float:
        return self.us_per_token("proxy") + self.us_per_token("Router")

    @property
    def ratio(self) -> float:
        return self.load.tok_per_s / self.alone.tok_per_s


def served(target: str, pids: dict[str, int], batch, tokens: int, interval: int):
    """The load through `target`, and each process's CPU seconds meanwhile."""
    with LoadClient(target, APP, [greedy_request(p, tokens, interval) for p in batch]) as client:
        before = cpu_seconds(pids)
        client.go()
        after = cpu_seconds(pids)
        load = client.result()
    cpu = {name: after[name] - before[name] for name in after if name in before}
    return load, {**cpu, "client": load.client_cpu_s}


def measure(grpc_port: int, a, checkpoint: str) -> tuple[list[Point], str]:
    from ray import serve

    app = app_config(checkpoint, a)
    vocab = describe_model(app.model).spec.vocab_size
    with deployed([app]):
        wait_ready(stub(grpc_port), APP, prompts(1, PROMPT, vocab, 0)[0])
        pids = {k.split("/")[-1]: v for k, v in serving_processes({APP: APP}).items()}
        to = {"proxy": f"127.0.0.1:{grpc_port}"}
        if "direct" in a.path_names:
            router = serve.get_deployment_handle("Router", app_name=APP)
            to["direct"] = router.grpc_endpoint.remote().result()
        for path in a.path_names:  # warm each path up
            run_load(to[path], APP, [greedy_request(p, 16) for p in prompts(4, 16, vocab, 1)])
        engine = EngineAlone(app)
        points = []
        for k, n in enumerate(a.stream_counts):
            batch = prompts(n, PROMPT, vocab, 100 + k)
            runs = [one_round(engine, to, pids, batch, a) for _ in range(a.repeats)]
            points += [median_run([r[key] for r in runs]) for key in runs[0]]
        engine.pool.shutdown()
        return points, kv_transport(app)


def one_round(engine: EngineAlone, to: dict[str, str], pids, batch, a) -> dict:
    """The batch by every path and interval, the engine alone before and after (averaged)."""
    alone = engine.run(batch, a.tokens)
    runs = {}
    for path in a.path_names:
        for interval in a.intervals:
            runs[path, interval] = load, _ = served(to[path], pids, batch, a.tokens, interval)
            report.log(f"N={len(batch)} {path}/{interval}: {load.tok_per_s:.0f} tok/s")
    alone = alone.mean(engine.run(batch, a.tokens))
    return {
        key: Point(len(batch), key[0], key[1], load, alone, cpu)
        for key, (load, cpu) in runs.items()
    }


def median_run(points: list[Point]) -> Point:
    """The run of median ratio (the lower middle of an even count), with every run's ratio
    and added latency per token."""
    chosen = sorted(points, key=lambda p: p.ratio)[(len(points) - 1) // 2]
    added = tuple(p.load.itl(0.5) - p.alone.step_s for p in points)
    return replace(chosen, ratios=tuple(p.ratio for p in points), added_s=added)


def render(a, argv: list[str], points: list[Point], transport: str, wall_s: float) -> str:
    cores = ",".join(map(str, a.decode_engine_cpus)) or "unpinned"
    lines = [
        *report.header("Serving-path capacity", "serving_bench", argv, a.device),
        f"- `{a.preset}` preset, {a.dtype} on {a.device}, {a.threads} torch thread(s) an "
        f"engine; 1 router, 1 prefill, 1 decode replica; KV over {transport}; decode engine "
        f"thread {cores}; {a.tokens} tokens a stream, {PROMPT}-token prompts; "
        f"{a.repeats} round(s) each; wall time {wall_s:.0f} s",
        "",
    ]
    for path in a.path_names:
        for interval in a.intervals:
            shown = [p for p in points if p.path == path and p.interval == interval]
            title = f"## {path}" + (f", stream_interval {interval}" if interval > 1 else "")
            lines += [title, "", *table(shown), ""]
    lines += ["## Targets", "", *verdicts(points), ""]
    streams, tokens = max(a.stream_counts), a.tokens
    lines += reference_rows(streams, tokens, a.repeats)
    return "\n".join(lines)


def table(points: list[Point]) -> list[str]:
    def row(label: str, cell) -> str:
        return f"| {label} | " + " | ".join(cell(p) for p in points) + " |"

    def ms(x: float, y: float) -> str:
        return f"{1e3 * x:,.1f} / {1e3 * y:,.1f}"

    lines = [
        row("streams (N)", lambda p: str(p.streams)),
        "|---|" + "---|" * len(points),
        row("delivered tok/s", lambda p: f"{p.load.tok_per_s:,.0f}"),
        row("engine alone tok/s", lambda p: f"{p.alone.tok_per_s:,.0f}"),
        row("delivered / engine alone", lambda p: f"{p.ratio:.2f}"),
        row("every run", lambda p: ", ".join(f"{r:.2f}" for r in p.ratios)),
        row("tokens per message", lambda p: f"{p.load.tokens / p.load.messages:.2f}"),
        row("**proxy + router CPU µs / token**", lambda p: f"**{p.path_us:,.0f}**"),
    ]
    for process in PROCESSES:
        lines.append(
            row(f"{process} CPU µs / token", lambda p, q=process: f"{p.us_per_token(q):,.0f}")
        )
    return lines + [
        row("TTFT p50 / p99 (ms)", lambda p: ms(p.load.ttft(0.5), p.load.ttft(0.99))),
        row("ITL p50 / p99 (ms)", lambda p: ms(p.load.itl(0.5), p.load.itl(0.99))),
        row(
            "all decoding after (ms), served / alone",
            lambda p: ms(p.load.all_decoding_s(), p.alone.ramp_s),
        ),
    ]


def verdicts(points: list[Point]) -> list[str]:
    lines = []
    for p in points:
        what = f"{p.path}" + (f", stream_interval {p.interval}" if p.interval > 1 else "")
        if p.streams == 64:
            ok_us, ok_ratio = p.path_us <= TARGET_PATH_US, p.ratio >= TARGET_RATIO
            lines += [
                f"- {what}, N = 64: proxy + router {p.path_us:,.0f} µs CPU per token, target "
                f"≤ {TARGET_PATH_US:.0f}: **{'PASS' if ok_us else 'FAIL'}**",
                f"- {what}, N = 64: delivered {p.ratio:.2f}x the engine alone, target ≥ "
                f"{TARGET_RATIO}x: **{'PASS' if ok_ratio else 'FAIL'}**",
            ]
        if p.streams == 1 and p.interval == 1:
            low, high, cover = report.median_ci(list(p.added_s))
            med = 1e3 * statistics.median(p.added_s)
            verdict = report.bounded_verdict(1e3 * low, 1e3 * high, TARGET_ADDED_MS)
            lines.append(
                f"- {what}, N = 1: serving adds {med:+.2f} ms per token (median of "
                f"{len(p.added_s)} pairs, {cover:.0%} CI {1e3 * low:+.2f} to {1e3 * high:+.2f}), "
                f"target ≤ {TARGET_ADDED_MS:g} ms: **{verdict}**"
            )
    return lines or ["(no N = 1 or N = 64 run: targets not checked)"]


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    checkpoint = str(report.model_dir(a))
    began = time.perf_counter()
    points, transport = report.with_threads(
        a.threads, lambda: on_serve(a.grpc_port, lambda port: measure(port, a, checkpoint))
    )
    return report.publish(render(a, argv, points, transport, time.perf_counter() - began), a.out)


if __name__ == "__main__":
    main()
