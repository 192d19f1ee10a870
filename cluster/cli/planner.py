"""`pdserve profile` (fit a `Profile` from probes of a running deployment) and `pdserve plan`
(simulate the splits of N replicas on a workload and pick the one with the most goodput).

    pdserve profile [--target HOST:9000] --out profile.json
    pdserve profile --merge tp1.json tp2.json --out profile.json
    pdserve plan --profile profile.json (--trace T | --mix IN:OUT[:W] ...) \\
        --slo-ttft-ms X --slo-itl-ms Y (--replicas N | --gpus N [--tp-choices 1 2 4]) \\
        [--out config.yaml]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import yaml

from cluster.client.load_generator import model_info
from cluster.client.workload import TRACES, TraceScale, load_trace
from cluster.errors import InvalidArgument
from cluster.planner.planner import Candidate, Plan, plan, plan_gpus
from cluster.planner.probe import ProbePlan, fit_profile, run_probes
from cluster.planner.profile import EngineLimits, Profile, merge_profiles
from cluster.planner.serve_config import serve_config
from cluster.planner.sim_workload import RequestClass, mix_requests, trace_requests
from cluster.planner.simulator import ClusterShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:9000", help="gRPC address of a cluster")
    p.add_argument("--application", default=None, help="Serve application (default: the only one)")
    p.add_argument("--out", default="profile.json", help="write the profile (JSON) here")
    p.add_argument(
        "--max-num-seqs", type=int, default=128, help="the deployment's max_num_seqs per replica"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="the deployment's tokens per engine step (the CPU default; 8192 on a GPU)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes per token of the served model (default: from --model's config.json)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory of the served model, read for its KV shape "
        "(default: the embedded tiny model)",
    )
    p.add_argument("--repeats", type=int, default=2, help="times each prefill probe is sent")
    p.add_argument("--decode-output", type=int, default=32, help="output tokens of decode probes")
    p.add_argument("--machine", default=None, help="what it runs on (default: host and CPU)")
    p.add_argument("--seed", type=int, default=0, help="prompt tokens' seed")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="PROFILE",
        help="probe nothing: merge profiles of different TP sizes into --out (default: none)",
    )


def profile_main(args: argparse.Namespace) -> int:
    if args.merge:
        return _merge(args.merge, args.out)
    info = asyncio.run(model_info(args.target, args.application))
    from cluster.client.generation_client import GenerationClient

    with GenerationClient(args.target, args.application) as client:
        stats = client.stats()
    if not stats.kv_transport:
        raise InvalidArgument("profile a disaggregated deployment: it times the KV hop too")
    # 0: a server from before the field, whose replicas are all TP 1.
    sizes = {r.tensor_parallel_size or 1 for r in stats.replicas if r.pool in ("prefill", "decode")}
    if len(sizes) > 1:
        raise InvalidArgument(
            f"the pools' tensor_parallel_size differ ({sorted(sizes)}): profile a deployment "
            "whose prefill and decode replicas have one size"
        )
    tp = sizes.pop() if sizes else 1
    blocks = [r.kv_blocks_total for r in stats.replicas if r.pool == "decode"] or [1024]
    # "auto" is decided by each replica where it runs: the decode replicas' dtype.
    dtype = next((r.dtype for r in stats.replicas if r.pool == "decode" and r.dtype), info.dtype)
    limits = EngineLimits(
        args.max_num_seqs, args.max_num_batched_tokens, min(blocks), info.block_size
    )
    probes = ProbePlan.design(info.max_context_length, limits, args.repeats, args.decode_output)
    print(f"sending {probes.requests} probe requests to {args.target} ...")
    records = run_probes(
        args.target, probes, info.vocab_size, args.application, args.seed, args.timeout
    )
    source = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": args.machine or f"{platform.node()} ({platform.processor() or 'cpu'})",
        "model_id": info.model_id,
        "dtype": dtype,
        "target": args.target,
        "probes": probes.requests,
        "tensor_parallel_size": tp,
    }
    per_token = args.kv_bytes_per_token or kv_bytes_per_token(args.model, dtype)
    try:
        profile = fit_profile(
            records, limits, stats.kv_transport, per_token, args.decode_output, source
        )
    except ValueError as e:
        raise SystemExit(f"profile: {e}") from None
    profile = replace(profile, tensor_parallel_size=tp)
    profile.save(args.out)
    print(json.dumps(profile.to_json(), indent=2))
    print(f"wrote {args.out}")
    return 0


def _merge(paths: list[str], out: str) -> int:
    try:
        merged = merge_profiles([Profile.load(p) for p in paths])
    except ValueError as e:
        raise InvalidArgument(str(e), param="merge") from None
    merged.save(out)
    print(f"wrote {out}: TP sizes {', '.join(map(str, merged.tp_sizes()))}")
    return 0


def kv_bytes_per_token(model: str | None, dtype: str) -> int:
    """2 (K and V) x layers x KV heads x head dim x the dtype's bytes, from config.json."""
    if model is None:
        from cluster.model.make_model import default_model_dir

        model = str(default_model_dir())
    try:
        c = json.loads((Path(model) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 2)
    except (OSError, KeyError, ValueError) as e:
        raise InvalidArgument(
            f"--model {model}: no KV shape ({e}); give --kv-bytes-per-token"
        ) from None


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        required=True,
        help="a profile written by pdserve profile (required, no default)",
    )
    w = p.add_argument_group("workload: a trace, or a synthetic mix")
    w.add_argument(
        "--trace",
        default=None,
        help=f"Mooncake-format JSONL trace, or a shipped one: {', '.join(TRACES)} (default: none)",
    )
    w.add_argument("--max-requests", type=int, default=1000, help="trace: requests replayed")
    w.add_argument("--skip", type=int, default=0, help="trace: start after its first N requests")
    w.add_argument("--length-scale", type=float, default=1.0, help="trace prompt lengths times S")
    w.add_argument("--output-scale", type=float, default=1.0, help="trace output lengths times O")
    w.add_argument("--time-scale", type=float, default=1.0, help="trace clock times T")
    w.add_argument(
        "--mix",
        nargs="+",
        default=None,
        metavar="IN:OUT[:W]",
        help="request classes of a synthetic mix, e.g. 2048:16:3 256:512 (default: none)",
    )
    w.add_argument("--rate", type=float, default=1.0, help="mix: Poisson arrivals per second")
    w.add_argument("--num-requests", type=int, default=1000, help="mix: requests")
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        required=True,
        help="time to first token SLO (required, no default)",
    )
    p.add_argument(
        "--slo-itl-ms",
        type=float,
        required=True,
        help="inter-token latency SLO: a request's mean gap after its first token "
        "(required, no default)",
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--replicas",
        type=int,
        help="engine replicas to split, at the profile's top-level TP size "
        "(this or --gpus; no default)",
    )
    size.add_argument(
        "--gpus",
        type=int,
        help="GPUs to share among replicas of the --tp-choices sizes (this or --replicas; "
        "no default)",
    )
    p.add_argument(
        "--tp-choices",
        type=int,
        nargs="+",
        default=None,
        help="--gpus: tensor-parallel sizes a replica may have (default: the profile's)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the profile's")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: profile's")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: the profile's")
    p.add_argument("--no-prefix-affinity", action="store_true", help="Serve's default routing")
    p.add_argument("--transport", default=None, help="KV transport (default: the profile's)")
    p.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    p.add_argument(
        "--out",
        default=None,
        help="write the best shape's Serve config (YAML) here (default: none)",
    )
    p.add_argument("--base-config", default=None, help="Serve config to resize (default: none)")
    p.add_argument("--model", default=None, help="model path for --out (default: embedded tiny)")
    p.add_argument("--json", action="store_true", help="print JSON, not a table")


def plan_main(args: argparse.Namespace) -> int:
    try:
        profile = Profile.load(args.profile)
    except ValueError as e:
        raise InvalidArgument(str(e), param="profile") from None
    overrides = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": args.num_kv_blocks,
    }
    profile = profile.with_limits(**{k: v for k, v in overrides.items() if v is not None})
    limits = profile.limits
    if args.tp_choices and not args.gpus:
        raise InvalidArgument("--tp-choices goes with --gpus", param="tp_choices")
    requests = _requests(args, limits)
    base = ClusterShape(prefix_affinity=not args.no_prefix_affinity, transport=args.transport)
    result = _search(args, profile, requests, base)
    best = result.best
    tp = args.gpus is not None
    if args.json:
        rows = [_row(c, tp) for c in result.candidates]
        print(json.dumps({"candidates": rows, "best": _row(best, tp)}))
    else:
        size = f"{args.gpus} GPUs" if tp else f"{args.replicas} replicas"
        print(f"{len(requests)} requests; SLOs: TTFT {args.slo_ttft_ms:g} ms, ITL (TPOT) "
              f"{args.slo_itl_ms:g} ms; {size}\n")  # fmt: skip
        print(*render(result.candidates, best, args.gpus), sep="\n")
    if args.out:
        base_file = yaml.safe_load(Path(args.base_config).read_text()) if args.base_config else None
        transport = profile.transfer(args.transport).transport
        doc = serve_config(_sized(best.shape, profile), limits, transport, args.model, base_file)
        Path(args.out).write_text(
            f"# pdserve plan: {best.shape.describe(tp)} for {args.profile}\n"
            + yaml.safe_dump(doc, sort_keys=False)
        )
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _search(args: argparse.Namespace, profile: Profile, requests: list, base: ClusterShape) -> Plan:
    slos = (args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    if args.gpus is None:  # replicas of the size the profile's top-level models are for
        tp = profile.tensor_parallel_size
        base = replace(base, prefill_tp=tp, decode_tp=tp)
        return plan(profile, requests, args.replicas, *slos, base, args.seed)
    choices = tuple(args.tp_choices) if args.tp_choices else None
    try:
        return plan_gpus(profile, requests, args.gpus, *slos, choices, base, args.seed)
    except ValueError as e:
        raise InvalidArgument(str(e), param="tp_choices") from None


def _sized(shape: ClusterShape, profile: Profile) -> ClusterShape:
    """`shape` with each pool's engine limits those of the profile at its TP size."""
    decode = shape.decode_limits or profile.at_tp(shape.decode_tp).limits
    if shape.mode == "colocated":
        return replace(shape, decode_limits=decode)
    prefill = shape.prefill_limits or profile.at_tp(shape.prefill_tp).limits
    return replace(shape, prefill_limits=prefill, decode_limits=decode)


def _requests(args: argparse.Namespace, limits: EngineLimits):
    if bool(args.trace) == bool(args.mix):
        raise InvalidArgument("give a workload: --trace or --mix (one of them)")
    try:
        if args.trace:
            entries = load_trace(args.trace, args.max_requests, args.skip)
            scale = TraceScale(args.length_scale, args.time_scale, args.output_scale)
            return trace_requests(entries, scale, limits.block_size)
        classes = [RequestClass.parse(c) for c in args.mix]
        rate = args.rate if args.rate > 0 else math.inf
        return mix_requests(classes, args.num_requests, rate, limits.block_size, args.seed)
    except (OSError, ValueError) as e:
        raise InvalidArgument(str(e)) from None


def _row(c: Candidate, tp: bool = False) -> dict:
    s = c.summary
    return {
        "shape": c.shape.describe(tp),
        "gpus": c.shape.gpus,
        "goodput_rps": s.goodput_rps,
        "attainment": s.attainment,
        "ttft_p90_s": s.ttft_s["p90"],
        "tpot_p90_s": s.tpot_s["p90"],
        "bottleneck": s.bottleneck,
        "utilization": s.utilization,
    }


def render(candidates: list[Candidate], best: Candidate, gpus: int | None = None) -> list[str]:
    """A markdown table of the candidates; with `gpus`, shapes name their TP sizes and those
    that leave GPUs idle say how many they use."""
    lines = [
        "| shape | goodput req/s | attainment | TTFT p90 ms | TPOT p90 ms | busy P / D "
        "| bottleneck |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in candidates:
        s = c.summary
        util = " / ".join(f"{s.utilization.get(p, 0):.0%}" for p in ("prefill", "decode"))
        mark = " **best**" if c is best else ""
        if gpus is not None and c.shape.gpus < gpus:
            mark = f" ({c.shape.gpus} GPUs){mark}"
        shape = c.shape.describe(gpus is not None)
        lines.append(
            f"| {shape}{mark} | {s.goodput_rps:.3g} | {s.attainment:.1%} | "
            f"{s.ttft_s['p90'] * 1e3:.1f} | {s.tpot_s['p90'] * 1e3:.1f} | {util} | "
            f"{s.bottleneck} |"
        )
    lines.append(f"\nbest: {best.shape.describe(gpus is not None)}")
    return lines
