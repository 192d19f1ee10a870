"""`pdserve bench` (a workload's latencies and throughput) and `pdserve phases` (which phase
dominates a workload, predicted and measured), both against a running server.

    pdserve bench [--target HOST:9000] --trace mooncake|FILE [--length-scale S] [--time-scale T]
    pdserve bench [--target HOST:9000] --num-requests N --input-len L --output-len M [--rate R]
    pdserve bench --backend openai --base-url http://HOST:8000/v1 (the same workload options)
    pdserve phases [--target HOST:9000] (the same workload options)

The workload is a Mooncake-format trace (`cluster.client.workload`) or synthetic random prompts.
Every request is greedy with EOS ignored, so outputs have the workload's lengths. `bench` sends
it over pdserve's gRPC API (`--backend pdserve`) or as streamed OpenAI completions to any
OpenAI-compatible server (`cluster.client.openai_load`), so one workload measures both.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from pathlib import Path

from cluster.cli.bench_run import (
    OPENAI_VOCAB_SIZE,
    emit,
    header,
    metadata,
    replay,
    setup,
    write_text,
)
from cluster.cli.version import package_version
from cluster.client.bench_plots import missing_extra, write_plots
from cluster.client.bench_result import bench_document, strict_json
from cluster.client.bench_summary import METRICS, PHASES, BenchSummary, Goodput
from cluster.client.load_generator import run_workload
from cluster.client.phase_model import PhaseModel, probe_workload
from cluster.client.workload import TRACES, TraceScale, Workload, synthetic_workload

BACKENDS = ("pdserve", "openai", "openai-chat")


def add_arguments(p: argparse.ArgumentParser, slo: bool = True) -> None:
    """The workload and output options of both verbs; with `slo` (bench) also the backend,
    goodput, detailed-record and plot options."""
    p.add_argument("--target", default="127.0.0.1:9000", help="gRPC address of a cluster")
    p.add_argument(
        "--application",
        default=None,
        help="Serve application, when Serve runs several (default: the only one)",
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="pdserve: send the requests round robin to the routers' own gRPC endpoints, "
        "listed by GetStats through --target, not through Serve's proxy (default: the proxy)",
    )
    _workload_arguments(p.add_argument_group("workload: a trace, or synthetic random prompts"))
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: unbounded)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    if slo:
        _bench_arguments(p)
    else:
        p.set_defaults(backend="pdserve", vocab_size=None)
    p.add_argument("--json", action="store_true", help="print one JSON object, not Markdown")
    p.add_argument(
        "--out", default=None, help="also write the report to this file (default: stdout only)"
    )


def _workload_arguments(w) -> None:
    w.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL trace to replay (.gz read as gzip), or a shipped one by "
        f"name: {', '.join(TRACES)} (default: synthetic random prompts)",
    )
    w.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="replay N requests of the trace (default: all)",
    )
    w.add_argument("--skip", type=int, default=0, help="start after the trace's first N requests")
    w.add_argument(
        "--length-scale",
        type=float,
        default=TraceScale.length,
        help="trace prompt lengths times this (default 1/32: a 512-token block is 16 tokens)",
    )
    w.add_argument(
        "--output-scale",
        type=float,
        default=TraceScale.output,
        help="trace output lengths times this",
    )
    w.add_argument(
        "--time-scale",
        type=float,
        default=TraceScale.time,
        help="trace clock times this (2 = half the request rate)",
    )
    # Each under vllm bench serve's name too (--num-prompts, --random-input-len, ...).
    w.add_argument("--num-requests", "--num-prompts", type=int, default=16, help="requests to send")
    w.add_argument(
        "--input-len", "--random-input-len", type=int, default=128, help="synthetic: prompt tokens"
    )
    w.add_argument(
        "--output-len", "--random-output-len", type=int, default=32, help="synthetic: output tokens"
    )
    w.add_argument(
        "--dataset-name",
        choices=("random",),
        default="random",
        help="vllm bench serve's synthetic dataset; a trace is --trace",
    )
    w.add_argument(
        "--rate",
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s, Poisson (default: all at once)",
    )
    w.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompt tokens' seed (default: a new one per run, so that no prompt is in the "
        "prefix cache from an earlier run)",
    )


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("backend: pdserve over gRPC, or any OpenAI-compatible server")
    b.add_argument(
        "--backend",
        choices=BACKENDS,
        default="pdserve",
        help="pdserve: gRPC to --target; openai / openai-chat: streamed /completions or "
        "/chat/completions under --base-url",
    )
    b.add_argument(
        "--base-url",
        default=None,
        help="OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (default: none; needed by the "
        "openai backends)",
    )
    b.add_argument(
        "--model",
        default=None,
        help="openai backends: the served model's id (default: the first of GET /models)",
    )
    b.add_argument(
        "--api-key",
        default=None,
        help="openai backends: bearer token (default: $OPENAI_API_KEY, else none)",
    )
    b.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="draw prompt token ids below this (default: the model's over gRPC, "
        f"{OPENAI_VOCAB_SIZE} for the openai backends)",
    )
    r = p.add_argument_group("results")
    r.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for request_goodput, as vllm bench serve: ttft:MS tpot:MS e2el:MS "
        "(default: none)",
    )
    r.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el",
        help="latencies whose percentiles the JSON result reports (vllm bench serve's)",
    )
    r.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        help="percentiles to report, comma-separated (vllm bench serve's)",
    )
    r.add_argument(
        "--result-dir",
        default=None,
        metavar="DIR",
        help="write the JSON result (vllm bench serve's keys) into DIR (default: none)",
    )
    r.add_argument(
        "--result-filename",
        default=None,
        metavar="NAME",
        help="its file name (default: pdserve-<backend>-<rate>qps-<time>.json)",
    )
    r.add_argument(
        "--save-detailed",
        default=None,
        metavar="FILE",
        help="write the JSON result with per-request columns (input/output lengths, TTFT, "
        "ITLs, end to end, phase timings, errors) to FILE (default: none)",
    )
    r.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="write PNGs into DIR: TTFT and ITL CDFs, latency over time, phases per request, "
        "replicas over time (needs the plot extra; default: none)",
    )


def bench_main(args: argparse.Namespace) -> int:
    """The exit status: 1 when no request of the workload completed."""
    if args.plot and (hint := missing_extra()):
        raise SystemExit(hint)
    try:
        goodput = Goodput.parse(args.goodput) if args.goodput else None
        shown = percentile_options(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    server, workload = setup(args)
    detailed = bool(args.save_detailed or args.plot)
    records, replicas = replay(args, server, workload, sample=detailed)
    summary = BenchSummary.of(records, goodput, *shown)
    meta = metadata(args, server, workload, package_version(), goodput)
    if args.result_dir or args.result_filename:
        path = result_path(args)
        write_text(str(path), strict_json(bench_document(meta, summary)) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    if args.save_detailed:
        doc = bench_document(meta, summary, records, replicas)
        write_text(args.save_detailed, strict_json(doc) + "\n")
    if args.plot:
        for path in write_plots(records, args.plot, replicas, f"pdserve bench ({args.backend})"):
            print(f"wrote {path}", file=sys.stderr)
    body = summary.render()
    emit(args, header(args, server, meta), "pdserve bench", bench_document(meta, summary), body)
    return 0 if summary.completed else 1


def phases_main(args: argparse.Namespace) -> int:
    server, workload = setup(args)
    longest = max(len(r.prompt_token_ids) for r in workload.requests)
    probes = probe_workload(
        server.max_context_length, server.vocab_size, longest, seed=args.seed + 7
    )
    _warm_up(args, server.vocab_size)
    probed = asyncio.run(
        run_workload(
            args.target,
            probes,
            args.application,
            max_concurrency=1,
            timeout_s=args.timeout,
            direct=args.direct,
        )  # fmt: skip
    )
    try:
        model = PhaseModel.fit(probed)
    except ValueError as e:
        raise SystemExit(f"phases: {e}") from None
    records, _ = replay(args, server, workload)
    summary = BenchSummary.of(records)
    predicted = model.predict_mean(workload)
    meta = metadata(args, server, workload, package_version())
    data = {
        **meta.to_json(),
        "model": {
            "prefill_s_coeffs": list(model.prefill.coeffs),
            "kv_transfer_s_coeffs": list(model.kv_transfer.coeffs),
            "proxy_s": model.proxy_s,
            "routing_s": model.routing_s,
            "decode_per_token_s": model.decode_per_token_s,
        },
        "predicted_mean_s": predicted,
        "predicted_dominant_phase": max(predicted, key=lambda k: predicted[k]),
        "measured": summary.metrics(),
    }
    body = render_phases(model, predicted, summary, workload)
    emit(args, header(args, server, meta), "pdserve phases", data, body)
    return 0 if summary.completed else 1


def render_phases(
    model: PhaseModel, predicted: dict[str, float], measured: BenchSummary, workload: Workload
) -> list[str]:
    total_p = sum(predicted.values())
    total_m = sum(measured.phase_mean_s.values())
    mean_prompt = round(workload.prompt_tokens / len(workload.requests))
    lines = [
        "Fitted from probe requests sent one at a time (no queue, no cache), n = prompt "
        f"tokens: prefill {model.prefill.describe('n')}; KV transfer "
        f"{model.kv_transfer.describe('n')}; proxy "
        f"{model.proxy_s * 1e3:.1f} ms; routing {model.routing_s * 1e3:.1f} ms; decode "
        f"{model.decode_per_token_s * 1e3:.2f} ms per output token after the first.",
        "",
        "| phase (mean per request) | predicted ms | share | measured ms | share |",
        "|---|---|---|---|---|",
    ]
    for k in PHASES:
        lines.append(
            f"| {k} | {predicted[k] * 1e3:.1f} | {predicted[k] / total_p:.1%} | "
            f"{measured.phase_mean_s[k] * 1e3:.1f} | {measured.phase_share(k):.1%} |"
        )
    lines.append(f"| end to end | {total_p * 1e3:.1f} | | {total_m * 1e3:.1f} | |")
    dom_p = max(predicted, key=lambda k: predicted[k])
    lines += [
        "",
        f"Dominant phase: predicted **{dom_p}**, measured **{measured.dominant_phase}**. "
        f"With prompts of {mean_prompt} tokens (this workload's mean), decoding takes longer "
        f"than prefill + KV transfer from {model.decode_overtakes_at(mean_prompt):g} output "
        "tokens on.",
        "",
        "The measured run:",
        "",
        *measured.render(),
    ]
    return lines


def _warm_up(args: argparse.Namespace, vocab_size: int) -> None:
    """One request first, so the probes do not carry the replicas' first-call costs."""
    warm = synthetic_workload(1, 16, 4, vocab_size, seed=args.seed + 99)
    asyncio.run(
        run_workload(
            args.target, warm, args.application, timeout_s=args.timeout, direct=args.direct
        )
    )


def percentile_options(args: argparse.Namespace) -> tuple[tuple[float, ...], tuple[str, ...]]:
    """`--metric-percentiles` and `--percentile-metrics`, checked."""
    try:
        pcts = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(
            f"--metric-percentiles: numbers, got {args.metric_percentiles!r}"
        ) from None
    if not all(0 < p <= 100 for p in pcts):
        raise ValueError("--metric-percentiles must lie in (0, 100]")
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(","))
    unknown = sorted(set(metrics) - set(METRICS))
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; known: {list(METRICS)}")
    return pcts, metrics


def result_path(args: argparse.Namespace) -> Path:
    rate = "inf" if math.isinf(args.rate) else f"{args.rate:g}"
    name = args.result_filename or (
        f"pdserve-{args.backend}-{rate}qps-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    return Path(args.result_dir or ".") / name
