"""Where the router's CPU per streamed message goes: Ray left out, then (`--in-serve`) put back.

    python -m benchmarks.router_path_bench [--streams 64] [--tokens 256] [--step-ms 10]
        [--repeats 3] [--in-serve [--grpc-port P]] [--preset tiny | --model-dir DIR] [--out FILE]

`capacity_bench` measures the router replica as deployed: its figure holds its gRPC server's
cost per message, pdserve's code, and what the Ray worker process adds (its threads, Serve's
loops, the metrics calls). This splits them apart, on the same loop Ray gives an actor (uvloop
when installed), in a server process of its own per configuration, `--streams` streams of
`--tokens` one-token messages each, one "engine step" every `--step-ms`:

- gRPC alone, two servers: a bare `pdserve.v1.Generation` servicer whose streams all wake from
  one event per step and yield one small `GenerateResponse` each, served by grpc.aio (one
  `sendmsg` per message) and by the router's own endpoint (router/grpc_endpoint.py: HTTP/2
  through `h2`, a loop turn's messages for a connection in one write).
- router code, no gRPC: the router's own path for a stream (router/token_stream.py's server,
  `Orchestrator` in colocated mode with its relay, tally and deadline, and
  `grpc_api.generate_responses`, which builds the protobuf messages), read by tasks in the
  server process. A worker double in another process sends each step's outputs for every
  stream as one frame through the real `TokenSender`, as a decode worker's engine thread does.
- router code behind its gRPC endpoint: the same, served by `GrpcEndpoint` (the router's
  direct endpoint) to this process's grpc.aio client: the `direct` path of `capacity_bench`
  without Ray.
- with `--in-serve`, the same in a Serve replica (`router_path_replica.py`: the environment
  Serve runs pdserve's router with, and the router's metrics recorded, as deployed), on a local
  Ray and Serve started for it (or, with `--grpc-port`, the running one): what Ray's worker
  process and Serve add per message to the plain process's figure.

Each figure is the server process's CPU (utime + stime from /proc) over the messages it sent,
the median of `--repeats` runs; the worker double's CPU per message is shown too. Every run
checks that each stream got its tokens in order and finished with reason "length".
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.options import checkpoint_options, model_dir
from benchmarks.proc_stats import cpu_seconds
from benchmarks.report import header, log, publish
from benchmarks.router_path_servers import (
    grpc_alone,
    read_stream,
    router_code,
    summary,
    worker_double,
)
from benchmarks.serve_session import on_serve

IN_SERVE = "the same in a Serve replica, router metrics on"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--streams", type=int, default=64, help="concurrent streams")
    p.add_argument("--tokens", type=int, default=256, help="one-token messages per stream")
    p.add_argument("--step-ms", type=float, default=10.0, help="time between engine steps")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    p.add_argument(
        "--in-serve", action="store_true", help="also run the router behind its endpoint in Serve"
    )
    p.add_argument(
        "--grpc-port", type=int, default=0, help="with --in-serve: a running Serve's gRPC port"
    )
    checkpoint_options(p, "router_path", preset="tiny")  # the model's config, no weights read
    return p.parse_args(argv)


def cpu_of(pid: int) -> float:
    """The process's utime + stime (proc_stats' reading)."""
    return cpu_seconds({"p": pid})["p"]


async def over_grpc(endpoint: str, streams: int, tokens: int) -> str:
    import grpc

    from cluster.pb.pdserve.v1 import generation_pb2 as pb
    from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = pb_grpc.GenerationStub(channel)

        def call(i: int):
            req = pb.GenerateRequest(request_id=f"s{i}", prompt_token_ids=[1, 2, 3])
            req.sampling.max_tokens = tokens
            return stub.Generate(req)

        results = await asyncio.gather(*[read_stream(call(i)) for i in range(streams)])
    return summary(results, tokens)


async def in_process(port: int, streams: int, tokens: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{streams} {tokens}\n".encode())
    line = await reader.readline()
    writer.close()
    return line.decode().strip()


@dataclass
class Runs:
    label: str
    server_us: list[float]  # per message, per repeat
    worker_us: list[float]  # empty: no worker double in this configuration
    messages: int

    @property
    def median(self) -> float:
        return statistics.median(self.server_us)


def measure(label: str, start: Callable, a: argparse.Namespace) -> Runs:
    """Start the configuration's processes (`start(ctx, ready)` -> processes, the server
    first), run the streams `--repeats` times, and stop them."""
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    procs = start(ctx, ready)
    try:
        endpoint = ready.get(timeout=120)
        server, worker = procs[0], procs[1] if len(procs) > 1 else None
        runs = Runs(label, [], [], 0)
        for _ in range(a.repeats):
            s0, w0 = cpu_of(server.pid), cpu_of(worker.pid) if worker else 0.0
            if endpoint.startswith("local:"):
                got = asyncio.run(in_process(int(endpoint[6:]), a.streams, a.tokens))
            else:
                got = asyncio.run(over_grpc(endpoint, a.streams, a.tokens))
            s1, w1 = cpu_of(server.pid), cpu_of(worker.pid) if worker else 0.0
            tokens, messages, wrong = map(int, got.split())
            if wrong or tokens != a.streams * a.tokens:
                raise RuntimeError(f"{label}: {wrong} streams wrong, {tokens} tokens: {got}")
            runs.server_us.append(1e6 * (s1 - s0) / messages)
            if worker is not None:
                runs.worker_us.append(1e6 * (w1 - w0) / messages)
            runs.messages = messages
            log(f"{label}: {runs.server_us[-1]:.1f} us per message ({messages} messages)")
        return runs
    finally:
        for p in procs:
            p.kill()
            p.join()


def configurations(a: argparse.Namespace, checkpoint: str) -> list[tuple[str, Callable]]:
    step_s = a.step_ms / 1e3

    def bare(own_endpoint: bool):
        def start(ctx, ready):
            args = (ready, step_s, own_endpoint)
            server = ctx.Process(target=grpc_alone, args=args, daemon=True)
            server.start()
            return [server]

        return start

    def worker(ctx, ready):
        """The worker double, started; and the port it listens on."""
        double = ctx.Process(target=worker_double, args=(ready, step_s), daemon=True)
        double.start()
        return double, ready.get(timeout=120)

    def router(with_grpc: bool):
        def start(ctx, ready):
            double, port = worker(ctx, ready)
            args = (ready, port, checkpoint, with_grpc)
            server = ctx.Process(target=router_code, args=args, daemon=True)
            server.start()
            return [server, double]

        return start

    def in_serve(ctx, ready):
        from benchmarks.router_path_replica import ServedRouterPath

        double, port = worker(ctx, ready)
        try:
            server = ServedRouterPath(port, checkpoint)
        except BaseException:
            double.kill()
            raise
        ready.put(server.endpoint)
        return [server, double]

    return [
        ("gRPC alone: grpc.aio", bare(False)),
        ("gRPC alone: the router's endpoint", bare(True)),
        ("router code, no gRPC", router(False)),
        ("router code behind its gRPC endpoint", router(True)),
    ] + ([(IN_SERVE, in_serve)] if a.in_serve else [])


def share(part: float, whole: float) -> str:
    """`part` as a percentage of `whole` ("-" for a run too short for /proc's 10 ms ticks)."""
    return f"{part / whole:.0%}" if whole > 0 else "-"


def render(a: argparse.Namespace, argv: list[str], runs: list[Runs], wall_s: float) -> str:
    aio, alone, code, both = runs[:4]
    lines = header(
        "Router path: CPU per streamed message, without Ray and in Serve", "router_path_bench", argv
    )
    lines += [
        f"- load: {a.streams} streams x {a.tokens} one-token messages, an engine step every "
        f"{a.step_ms:g} ms, {a.repeats} runs per configuration (median shown); "
        f"wall time {wall_s:.0f} s",
        "- server process CPU (utime + stime, /proc) over the messages it sent; the worker "
        "double sends the router's frames (one per step, as a decode worker's engine thread)",
        "",
        "| configuration | server CPU µs / message | runs | worker double µs / message |",
        "|---|---|---|---|",
    ]
    for r in runs:
        each = ", ".join(f"{x:.1f}" for x in r.server_us)
        worker = f"{statistics.median(r.worker_us):.1f}" if r.worker_us else "-"
        lines.append(f"| {r.label} | **{r.median:.1f}** | {each} | {worker} |")
    lines += [
        "",
        f"- the router's endpoint costs {alone.median:.1f} µs a message where grpc.aio costs "
        f"{aio.median:.1f} ({share(alone.median, aio.median)}), serving the same bare servicer",
        f"- of the router behind its endpoint ({both.median:.1f} µs), the endpoint alone "
        f"accounts for {alone.median:.1f} ({share(alone.median, both.median)}) and the router's "
        f"own code without gRPC for {code.median:.1f} ({share(code.median, both.median)}); the "
        f"rest ({both.median - alone.median - code.median:+.1f} µs) is what the two cost "
        "together beyond their sum",
    ]
    if len(runs) > 4:
        served = runs[4]
        lines.append(
            f"- in a Serve replica with the router's metrics on: {served.median:.1f} µs, "
            f"{served.median - both.median:+.1f} against the plain process; the deployed "
            "router's figure (`capacity_bench`, path `direct`) adds its per-request work "
            "(prefill and decode calls through Serve handles) and its idle CPU"
        )
    else:
        lines.append(
            "- `--in-serve` measures the same in a Serve replica; the deployed router's figure "
            "(`capacity_bench`, path `direct`) adds its per-request work and its idle CPU"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> str:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    checkpoint = str(model_dir(a))
    began = time.perf_counter()

    def measure_all(_port: int | None = None) -> list[Runs]:
        return [measure(label, start, a) for label, start in configurations(a, checkpoint)]

    runs = on_serve(a.grpc_port, measure_all) if a.in_serve else measure_all()
    return publish(render(a, argv, runs, time.perf_counter() - began), a.out)


if __name__ == "__main__":
    main()
