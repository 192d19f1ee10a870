"""One `pdserve bench` / `pdserve phases` run from its parsed options: find out what the server
serves (`Server`), build the workload, replay it on the chosen backend with a progress line
(sampling the pools' sizes when asked), describe the run (`metadata`) and print the report."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import random
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cluster.client.bench_result import RunMetadata, strict_json
from cluster.client.bench_summary import Goodput
from cluster.client.load_generator import (
    ReplicaSample,
    RequestRecord,
    model_info,
    run_workload,
    sample_replicas,
)
from cluster.client.openai_load import OpenAITarget, run_openai_workload, served_models
from cluster.client.progress import Progress
from cluster.client.workload import (
    TraceScale,
    Workload,
    load_trace,
    synthetic_workload,
    trace_workload,
)

# Prompt token ids are drawn below this on an OpenAI server, which does not say its vocabulary:
# every checkpoint pdserve's tests and presets build has at least this many.
OPENAI_VOCAB_SIZE = 512
UNKNOWN_CONTEXT = 1 << 30  # an OpenAI server that does not say its context: no prompt is cut


@dataclass(frozen=True)
class Server:
    """What the workload must fit: the served model, the token ids a prompt may use, the
    context; `about` describes it for the report's header."""

    model_id: str
    vocab_size: int
    max_context_length: int
    about: str


def check_limits(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    if not args.timeout > 0:
        raise SystemExit("--timeout must be > 0")
    if args.backend == "pdserve" and getattr(args, "base_url", None):
        raise SystemExit("--base-url is for the openai backends; pdserve's is --target")
    if args.backend != "pdserve" and args.direct:
        raise SystemExit("--direct is for the pdserve backend")
    if args.backend != "pdserve" and not args.base_url:
        raise SystemExit(f"--backend {args.backend} needs --base-url (e.g. http://HOST:8000/v1)")


def setup(args: argparse.Namespace) -> tuple[Server, Workload]:
    """The server's model and the workload fitted to it; SystemExit with one line when the
    server cannot be reached or the workload is bad. Draws a seed when none was given."""
    check_limits(args)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    try:
        server = asyncio.run(_pdserve_server(args) if args.backend == "pdserve" else _openai(args))
    except Exception as e:  # grpc.aio.AioRpcError, aiohttp.ClientError, a bad address
        where = args.target if args.backend == "pdserve" else args.base_url
        raise SystemExit(f"cannot reach a {args.backend} server at {where}: {e}") from None
    try:
        return server, workload_of(args, server)
    except (OSError, ValueError) as e:
        raise SystemExit(f"workload: {e}") from None


async def _pdserve_server(args: argparse.Namespace) -> Server:
    info = await model_info(args.target, args.application)
    about = (
        f"model {info.model_id} ({info.dtype}, context {info.max_context_length}, "
        f"KV block {info.block_size})"
    )
    return Server(info.model_id, info.vocab_size, info.max_context_length, about)


async def _openai(args: argparse.Namespace) -> Server:
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    models = await served_models(args.base_url, args.api_key)
    named = [m for m in models if m.id == args.model] or [models[0]]
    model_id = args.model or named[0].id
    context = named[0].max_model_len if named[0].id == model_id else None
    about = f"model {model_id} (context {context or 'not given'})"
    return Server(model_id, OPENAI_VOCAB_SIZE, context or UNKNOWN_CONTEXT, about)


def workload_of(args: argparse.Namespace, server: Server) -> Workload:
    vocab = args.vocab_size or server.vocab_size
    if args.trace is None:
        return synthetic_workload(
            args.num_requests, args.input_len, args.output_len, vocab,
            rate=args.rate, seed=args.seed,
        )  # fmt: skip
    scale = TraceScale(args.length_scale, args.time_scale, args.output_scale)
    entries = load_trace(args.trace, args.max_requests, args.skip)
    return trace_workload(entries, scale, vocab, server.max_context_length, args.seed)


def replay(
    args: argparse.Namespace, server: Server, workload: Workload, sample: bool = False
) -> tuple[list[RequestRecord], list[ReplicaSample] | None]:
    """Send the workload on the chosen backend, with a progress line on stderr unless
    --no-progress; with `sample` (pdserve only) also read the pools' sizes every second."""
    progress = Progress(len(workload.requests), enabled=not args.no_progress)
    sample = sample and args.backend == "pdserve"

    async def run() -> list[RequestRecord]:
        if args.backend == "pdserve":
            return await run_workload(
                args.target, workload, args.application,
                max_concurrency=args.max_concurrency, timeout_s=args.timeout, progress=progress,
                direct=args.direct,
            )  # fmt: skip
        target = OpenAITarget(
            args.base_url, server.model_id, args.backend == "openai-chat", args.api_key
        )
        return await run_openai_workload(
            target, workload, args.max_concurrency, args.timeout, progress=progress
        )

    async def run_sampled() -> tuple[list[RequestRecord], list[ReplicaSample] | None]:
        samples: list[ReplicaSample] = []
        sampler = None
        if sample:
            sampler = asyncio.create_task(sample_replicas(args.target, args.application, samples))
        try:
            return await run(), samples if sample else None
        finally:
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler

    return asyncio.run(run_sampled())


def metadata(
    args: argparse.Namespace,
    server: Server,
    workload: Workload,
    version: str,
    goodput: Goodput | None = None,
) -> RunMetadata:
    synthetic = args.trace is None
    rate = args.rate if synthetic and math.isfinite(args.rate) else None
    spec: dict = {"kind": "synthetic" if synthetic else "trace"}
    if synthetic:
        spec |= {"num_requests": args.num_requests, "input_len": args.input_len,
                 "output_len": args.output_len, "rate": rate}  # fmt: skip
    else:
        spec |= {"trace": args.trace, "skip": args.skip, "max_requests": args.max_requests,
                 "length_scale": args.length_scale, "time_scale": args.time_scale,
                 "output_scale": args.output_scale}  # fmt: skip
    spec |= {
        "description": workload.description,
        "vocab_size": args.vocab_size or server.vocab_size,
        "prompts_clipped": sum(r.clipped for r in workload.requests),
    }
    return RunMetadata(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        pdserve_version=version,
        backend=args.backend,
        target=args.target if args.backend == "pdserve" else args.base_url,
        application=args.application,
        model_id=server.model_id,
        seed=args.seed,
        request_rate=rate,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout,
        workload=spec,
        goodput=goodput,
    )


def header(args: argparse.Namespace, server: Server, meta: RunMetadata) -> list[str]:
    app = f", application {args.application}" if args.application else ""
    direct = ", direct to the routers" if args.direct else ""
    clipped = meta.workload["prompts_clipped"]
    return [
        f"- date: {meta.date}; pdserve {meta.pdserve_version}; client machine: "
        f"{os.cpu_count()} CPUs, {platform.platform()}",
        f"- target: {meta.target}{app} ({args.backend}{direct}); {server.about}",
        f"- workload: {meta.workload['description']}; seed {args.seed}"
        + (f"; at most {args.max_concurrency} in flight" if args.max_concurrency else "")
        + (f"; {clipped} prompts cut to fit the context" if clipped else ""),
        "",
    ]


def emit(args, header_lines: list[str], title: str, data: dict, body: list[str]) -> None:
    """Print (and with --out write) the report: one strict JSON object with --json (NaN and
    infinities as null), else Markdown."""
    if args.json:
        report = strict_json(data)
    else:
        report = "\n".join([f"# {title}", "", *header_lines, *body])
    print(report)
    if args.out is not None:
        write_text(args.out, report + "\n")


def write_text(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, "utf-8")
