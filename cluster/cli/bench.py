"""`pdserve bench` (a load generator and its report) and `pdserve phases` (which phase
dominates, predicted and measured), both against a running cluster over gRPC.

    pdserve bench [--target HOST:9000] --trace FILE [--length-scale S] [--time-scale T] ...
    pdserve bench [--target HOST:9000] --num-requests N --input-len L --output-len M [--rate R]
    pdserve phases [--target HOST:9000] (the same workload options)

The workload is a Mooncake-format trace (`cluster.client.workload`) or synthetic random prompts.
Every request is greedy with EOS ignored, so outputs have the workload's lengths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
from datetime import UTC, datetime
from pathlib import Path

from cluster.client.bench_summary import PHASES, BenchSummary
from cluster.client.load_generator import RequestRecord, model_info, run_workload
from cluster.client.phase_model import PhaseModel, probe_workload
from cluster.client.workload import (
    TraceScale,
    Workload,
    load_trace,
    synthetic_workload,
    trace_workload,
)


def add_arguments(p: argparse.ArgumentParser, slo: bool = True) -> None:
    p.add_argument("--target", default="127.0.0.1:9000", help="gRPC address of a cluster")
    p.add_argument(
        "--application",
        default=None,
        help="Serve application, when Serve runs several (default: the only one)",
    )
    w = p.add_argument_group("workload: a trace, or synthetic random prompts")
    w.add_argument(
        "--trace",
        default=None,
        help="Mooncake-format JSONL trace to replay (default: synthetic random prompts)",
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
    w.add_argument("--num-requests", type=int, default=16, help="synthetic: requests to send")
    w.add_argument("--input-len", type=int, default=128, help="synthetic: prompt tokens")
    w.add_argument("--output-len", type=int, default=32, help="synthetic: output tokens")
    w.add_argument(
        "--rate", type=float, default=math.inf, help="requests/s, Poisson (default: all at once)"
    )
    w.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompt tokens' seed (default: a new one per run, so that no prompt is in the "
        "prefix cache from an earlier run)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests in flight at most (default: unbounded)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    if slo:
        p.add_argument(
            "--slo-ttft-ms",
            type=float,
            default=None,
            help="SLO on time to first token: report the requests within it (default: none)",
        )
        p.add_argument(
            "--slo-tpot-ms",
            type=float,
            default=None,
            help="SLO on time per output token: report the requests within it (default: none)",
        )
    p.add_argument("--json", action="store_true", help="print one JSON object, not Markdown")
    p.add_argument(
        "--out", default=None, help="also write the report to this file (default: stdout only)"
    )


def workload_of(args: argparse.Namespace, info) -> Workload:
    if args.trace is None:
        return synthetic_workload(
            args.num_requests,
            args.input_len,
            args.output_len,
            info.vocab_size,
            rate=args.rate,
            seed=args.seed,
        )
    scale = TraceScale(args.length_scale, args.time_scale, args.output_scale)
    entries = load_trace(args.trace, args.max_requests, args.skip)
    return trace_workload(entries, scale, info.vocab_size, info.max_context_length, args.seed)


def bench_main(args: argparse.Namespace) -> int:
    info, workload = _setup(args)
    records = _run(args, workload)
    summary = BenchSummary.of(
        records,
        None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
        None if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3,
    )
    data, body = summary.to_json(), summary.render()
    return _emit(args, info, workload, "pdserve bench", data, body, summary.completed)


def phases_main(args: argparse.Namespace) -> int:
    info, workload = _setup(args)
    longest = max(len(r.prompt_token_ids) for r in workload.requests)
    probes = probe_workload(info.max_context_length, info.vocab_size, longest, seed=args.seed + 7)
    _warm_up(args, info)
    probed = asyncio.run(
        run_workload(
            args.target, probes, args.application, max_concurrency=1, timeout_s=args.timeout
        )
    )
    try:
        model = PhaseModel.fit(probed)
    except ValueError as e:
        raise SystemExit(f"phases: {e}") from None
    summary = BenchSummary.of(_run(args, workload))
    predicted = model.predict_mean(workload)
    data = {
        "model": {
            "prefill_s_coeffs": list(model.prefill.coeffs),
            "kv_transfer_s_coeffs": list(model.kv_transfer.coeffs),
            "proxy_s": model.proxy_s,
            "routing_s": model.routing_s,
            "decode_per_token_s": model.decode_per_token_s,
        },
        "predicted_mean_s": predicted,
        "predicted_dominant_phase": max(predicted, key=lambda k: predicted[k]),
        "measured": summary.to_json(),
    }
    body = render_phases(model, predicted, summary, workload)
    return _emit(args, info, workload, "pdserve phases", data, body, summary.completed)


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


def _setup(args: argparse.Namespace):
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    if not args.timeout > 0:
        raise SystemExit("--timeout must be > 0")
    if args.seed is None:
        args.seed = random.randrange(2**31)
    try:
        info = asyncio.run(model_info(args.target, args.application))
    except Exception as e:  # grpc.aio.AioRpcError, or a bad target
        raise SystemExit(f"cannot reach a pdserve cluster at {args.target}: {e}") from None
    try:
        return info, workload_of(args, info)
    except (OSError, ValueError) as e:
        raise SystemExit(f"workload: {e}") from None


def _run(args: argparse.Namespace, workload: Workload) -> list[RequestRecord]:
    return asyncio.run(
        run_workload(
            args.target,
            workload,
            args.application,
            max_concurrency=args.max_concurrency,
            timeout_s=args.timeout,
        )
    )


def _warm_up(args: argparse.Namespace, info) -> None:
    """One request first, so the probes do not carry the replicas' first-call costs."""
    warm = synthetic_workload(1, 16, 4, info.vocab_size, seed=args.seed + 99)
    asyncio.run(run_workload(args.target, warm, args.application, timeout_s=args.timeout))


def _header(args: argparse.Namespace, info, workload: Workload) -> list[str]:
    app = f", application {args.application}" if args.application else ""
    return [
        f"- date: {datetime.now(UTC).isoformat(timespec='seconds')}; client machine: "
        f"{os.cpu_count()} CPUs, {platform.platform()}",
        f"- target: {args.target}{app}; model {info.model_id} ({info.dtype}, context "
        f"{info.max_context_length}, KV block {info.block_size})",
        f"- workload: {workload.description}; seed {args.seed}"
        + (f"; at most {args.max_concurrency} in flight" if args.max_concurrency else "")
        + (f"; {sum(r.clipped for r in workload.requests)} prompts cut to fit the context"
           if any(r.clipped for r in workload.requests) else ""),
        "",
    ]  # fmt: skip


def _emit(
    args, info, workload: Workload, title: str, data: dict, body: list[str], completed: int
) -> int:
    """Print (and with --out write) the report: one JSON object with --json, else Markdown.
    The exit status: 1 when no request of the workload completed."""
    if args.json:
        report = json.dumps({"workload": workload.description, **data})
    else:
        report = "\n".join([f"# {title}", "", *_header(args, info, workload), *body])
    _publish(report, args.out)
    return 0 if completed else 1


def _publish(report: str, out: str | None) -> None:
    print(report)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(report + "\n", "utf-8")
