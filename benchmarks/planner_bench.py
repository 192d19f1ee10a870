"""The planner's predictions against measured runs: does the simulator, with a profile fitted
on this machine, predict what a deployment does?

    python -m benchmarks.planner_bench [--preset small] [--levels 0.4,0.8] [--seconds 50]
        [--trace FILE] [--skip 3800] [--max-requests 60] [--quick] [--acceptance] [--out FILE]

Two apps on one local Ray, each with two engines of one torch thread (as `trace_bench`):
1P+1D disaggregated and 2 colocated. `pdserve profile`'s code path probes the disaggregated
one for a fresh profile (written beside the report). Three workloads, a prompt-heavy and a
decode-heavy mix (Poisson arrivals) and the Mooncake slice (lengths x 1/32), each at the
`--levels` shares of the capacity the profile predicts for 1P+1D (all its requests sent at
once, simulated), are replayed on both apps, one after the other, and simulated on the same
shape with the same requests. Per run and figure (`planner_figures`): predicted, measured,
their ratio and whether it is within the bound (phase means 25 %, p90s 35 %).

Acceptance (the Mooncake slice at the highest level; SLOs from the profile, in the report):
`plan` over the shapes two engines make; its pick's measured goodput against the best
measured shape's and the worse one's, and its predicted attainment against the measured.
`--acceptance` runs only that workload; `--quick` a few requests at one level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.planner_figures import (
    Comparison,
    compare,
    measured_figures,
    measured_goodput,
    predicted_figures,
)
from benchmarks.report import header, log, publish, served_parser
from benchmarks.serve_session import deployed, measure_served, stub, used_blocks, wait_ready
from benchmarks.trace_bench import SHARED_TRACE, app_config
from cluster.cli.planner import add_profile_arguments, profile_main
from cluster.client.load_generator import RequestRecord, model_info, run_workload
from cluster.client.workload import (
    FIRST_TOKEN,
    TraceScale,
    Workload,
    WorkloadRequest,
    load_trace,
    trace_workload,
)
from cluster.planner.planner import plan
from cluster.planner.profile import Profile
from cluster.planner.sim_workload import RequestClass, SimRequest, mix_requests, trace_requests
from cluster.planner.simulator import ClusterShape, Simulator

APPS = {"disaggregated": "planner-pd", "colocated": "planner-co"}
MIXES = {
    "prompt-heavy": [RequestClass(384, 4, 3), RequestClass(128, 8, 1)],
    "decode-heavy": [RequestClass(32, 96, 3), RequestClass(64, 48, 1)],
}
MAX_NUM_SEQS = 32  # trace_bench's pools
TOKEN_BUDGET = 512


def shape(profile: Profile, mode: str) -> ClusterShape:
    if mode == "colocated":
        return ClusterShape(mode="colocated", prefill_replicas=0, decode_replicas=2)
    transport = profile.transfer().transport
    return ClusterShape(
        mode="disaggregated", prefill_replicas=1, decode_replicas=1, transport=transport
    )


@dataclass(frozen=True)
class Case:
    workload: str
    level: float  # share of 1P+1D's predicted capacity
    rate: float  # requests/s
    requests: list[SimRequest]
    work: Workload


@dataclass(frozen=True)
class Run:
    case: Case
    mode: str
    records: list[RequestRecord]
    comparisons: list[Comparison]
    used_blocks_after: int


def capacity(profile: Profile, requests: list[SimRequest]) -> float:
    """Requests/s 1P+1D completes, as simulated, when all of `requests` arrive at once."""
    burst = [replace(r, arrival_s=0.0) for r in requests]
    s = Simulator(profile, shape(profile, "disaggregated")).run(burst).summary()
    return s.completed / s.duration_s


def mix_case(a, name: str, level: float, profile: Profile, info) -> Case:
    """The mix's requests at `level` of the predicted capacity, lasting about `--seconds`;
    random prompts (no two share a block), the same for the simulator and the apps."""
    block = profile.limits.block_size
    cap = capacity(profile, mix_requests(MIXES[name], 200, math.inf, block, a.seed))
    rate = level * cap
    n = a.quick_requests or max(8, min(400, round(rate * a.seconds)))
    reqs = mix_requests(MIXES[name], n, rate, block, a.seed)
    rng = random.Random(a.seed)
    sent = tuple(
        WorkloadRequest(
            r.arrival_s,
            tuple(rng.randrange(FIRST_TOKEN, info.vocab_size) for _ in range(r.prompt_tokens)),
            r.output_tokens,
        )
        for r in reqs
    )
    mix = " + ".join(f"{c.input_len}:{c.output_len} x{c.weight:g}" for c in MIXES[name])
    return Case(name, level, rate, reqs, Workload(sent, f"{n} requests of {mix}, Poisson"))


def trace_case(a, level: float, profile: Profile, info) -> Case:
    """The Mooncake slice, its clock scaled so that its mean rate is `level` of the capacity."""
    entries = load_trace(a.trace, a.quick_requests or a.max_requests, a.skip)
    block, ctx = profile.limits.block_size, info.max_context_length
    cap = capacity(profile, trace_requests(entries, TraceScale(), block, ctx))
    span_s = max(1e-3, (entries[-1].timestamp_ms - entries[0].timestamp_ms) / 1e3)
    rate = level * cap
    scale = TraceScale(time=(len(entries) - 1) / span_s / rate)
    reqs = trace_requests(entries, scale, block, ctx)
    work = trace_workload(entries, scale, info.vocab_size, ctx, 0)
    return Case("mooncake", level, rate, reqs, work)


def slos(profile: Profile, case: Case) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in seconds: 4x the unloaded TTFT of the workload's mean prompt (its
    chunks of the token budget, the overheads), 2x a decode step at half of `max_num_seqs`
    holding the mean prompt and output."""
    n = len(case.requests)
    prompt = sum(r.prompt_tokens for r in case.requests) / n
    out = sum(r.output_tokens for r in case.requests) / n
    chunks = math.ceil(prompt / profile.limits.max_num_batched_tokens)
    pre = profile.prefill
    prefill = chunks * pre.base_s + pre.per_token_s * prompt + pre.per_attended_s * prompt**2 / 2
    over = profile.overheads.routing_s + profile.overheads.proxy_s
    batch = profile.limits.max_num_seqs / 2
    return 4 * (prefill + over), 2 * profile.decode.time(batch, batch * (prompt + out / 2))


def fresh_profile(a, model_dir: str, target: str) -> tuple[Profile, Path]:
    """`pdserve profile` against the disaggregated app, saved beside the report."""
    if a.out == "-":
        path = Path(tempfile.mkdtemp()) / "planner_profile.json"
    else:
        path = Path(a.out).with_name(Path(a.out).stem + "_profile.json")
    cli = argparse.ArgumentParser()
    add_profile_arguments(cli)
    args = cli.parse_args(
        ["--target", target, "--application", APPS["disaggregated"], "--out", str(path)]
        + ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(TOKEN_BUDGET)]
        + ["--model", model_dir, "--repeats", "1" if a.quick else "2"]
    )
    log(f"profiling {APPS['disaggregated']}")
    with contextlib.redirect_stdout(sys.stderr):
        profile_main(args)
    return Profile.load(path), path


@dataclass(frozen=True)
class Measured:
    profile: Profile
    profile_path: Path
    runs: list[Run]


def measure(a, model_dir: str, grpc_port: int) -> Measured:
    target = f"127.0.0.1:{grpc_port}"
    proxy = stub(grpc_port)
    configs = [app_config(a, model_dir, mode, name) for mode, name in APPS.items()]
    runs: list[Run] = []
    with deployed(configs):
        for name in APPS.values():
            wait_ready(proxy, name, list(range(16, 48)))
        info = asyncio.run(model_info(target, APPS["disaggregated"]))
        profile, path = fresh_profile(a, model_dir, target)
        names = ["mooncake"] if a.acceptance else [*MIXES, "mooncake"]
        for level in a.levels:
            for name in names:
                case = (
                    trace_case(a, level, profile, info)
                    if name == "mooncake"
                    else mix_case(a, name, level, profile, info)
                )
                for mode, app in APPS.items():
                    log(f"{name} at {level:.0%}: {len(case.requests)} requests on {app}")
                    records = asyncio.run(run_workload(target, case.work, app, timeout_s=600.0))
                    sim = Simulator(profile, shape(profile, mode), a.seed).run(case.requests)
                    pairs = compare(predicted_figures(sim), measured_figures(records), mode)
                    runs.append(Run(case, mode, records, pairs, used_blocks(proxy, app)))
    return Measured(profile, path, runs)


def ms(x: float) -> str:
    return "n/a" if x != x else f"{x * 1e3:.1f}"


def acceptance(profile: Profile, runs: list[Run]) -> list[str]:
    top = max(r.case.level for r in runs)
    by_mode = {r.mode: r for r in runs if r.case.workload == "mooncake" and r.case.level == top}
    case = by_mode["disaggregated"].case
    slo_ttft, slo_itl = slos(profile, case)
    base = shape(profile, "disaggregated")
    result = plan(profile, case.requests, 2, slo_ttft, slo_itl, base)
    picked = result.best
    measured = {m: measured_goodput(r.records, slo_ttft, slo_itl) for m, r in by_mode.items()}
    pick, good = picked.shape.mode, {m: g for m, (g, _) in measured.items()}
    best, worse = max(good.values()), min(good.values())
    points = 100 * (picked.summary.attainment - measured[pick][1])

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.2f}x" if y > 0 else "n/a"

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    lines = [
        "## Acceptance: plan's pick on the Mooncake slice",
        "",
        f"At {top:.0%} of 1P+1D's predicted capacity ({case.rate:.2f} requests/s). SLOs from "
        f"the profile: TTFT {slo_ttft * 1e3:.0f} ms (4x the unloaded TTFT of the mean prompt), "
        f"TPOT {slo_itl * 1e3:.1f} ms (2x a decode step at half of max_num_seqs). Shapes of "
        "two engines only (1P+1D, 2 colocated): a third one-thread engine beside the router "
        "and proxies would oversubscribe 2 cores.",
        "",
        "| shape | predicted goodput req/s | measured goodput req/s | predicted attainment "
        "| measured attainment |",
        "|---|---|---|---|---|",
    ]
    for c in result.candidates:
        g, att = measured[c.shape.mode]
        name = c.shape.describe() + (" (picked)" if c.shape.mode == pick else "")
        s = c.summary
        lines.append(f"| {name} | {s.goodput_rps:.3f} | {g:.3f} | {s.attainment:.1%} | {att:.1%} |")
    lines += [
        "",
        f"- plan's pick: {picked.shape.describe()}",
        f"- its measured goodput / the best measured: {ratio(good[pick], best)} (>= 0.90: "
        f"{verdict(best > 0 and good[pick] >= 0.9 * best)})",
        f"- its measured goodput / the worse of 1P+1D and colocated: {ratio(good[pick], worse)}"
        f" (>= 1.5: {verdict(good[pick] >= 1.5 * worse and good[pick] > 0)})",
        f"- predicted - measured attainment: {points:+.1f} points (within 10: "
        f"{verdict(abs(points) <= 10)})",
    ]
    return lines


def render(a, argv: list[str], m: Measured, wall_s: float) -> str:
    profile, runs = m.profile, m.runs
    pre, dec, kv = profile.prefill, profile.decode, profile.transfer()
    lines = [
        *header("pdserve planner: predicted against measured", "planner_bench", argv),
        f"- wall time {wall_s:.0f} s",
        f"- apps: 1P+1D disaggregated and 2 colocated, one torch thread per engine, "
        f"max_num_seqs {MAX_NUM_SEQS}, {TOKEN_BUDGET} tokens a step, {a.num_blocks} KV blocks "
        f"of 16 tokens per replica; each run on 1P+1D first, then on colocated",
        f"- profile (`pdserve profile` on 1P+1D, `{m.profile_path.name}`): prefill step "
        f"{ms(pre.base_s)} ms + {pre.per_token_s * 1e6:.1f} us/token + "
        f"{pre.per_attended_s * 1e9:.2f} ns/attended; decode step {ms(dec.base_s)} ms + "
        f"{dec.per_seq_s * 1e6:.1f} us/seq + {dec.per_context_s * 1e9:.2f} ns/context token; KV "
        f"({kv.transport}) {ms(kv.fixed_s)} ms + {kv.bandwidth_bytes_per_s / 1e9:.3g} GB/s; "
        f"routing {ms(profile.overheads.routing_s)} ms, proxy {ms(profile.overheads.proxy_s)} ms",
        "- phases, measured <- simulated: queue <- queue, prefill <- prefill, kv_transfer <- "
        "kv_transfer, decode (server total - TTFT - KV transfer) <- kv_wait + decode; TTFT, "
        "ITL (every gap) and TPOT (a request's mean gap; the SLO's) p90 as the client sees them",
        "",
        "| workload | load | requests | rate req/s | workload details |",
        "|---|---|---|---|---|",
    ]
    seen = []
    for r in runs:
        if r.case not in seen:
            seen.append(r.case)
            c = r.case
            lines.append(f"| {c.workload} | {c.level:.0%} | {len(c.requests)} | {c.rate:.2f} "
                         f"| {c.work.description} |")  # fmt: skip
    lines += [
        "",
        "| workload | load | app | figure | predicted ms | measured ms | predicted / measured "
        "| bound | within |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    within = total = 0
    for r in runs:
        for c in r.comparisons:
            within, total = within + c.within, total + 1
            ratio = "n/a" if c.ratio != c.ratio else f"{c.ratio:.2f}"
            bound = "25%" if c.figure in ("queue", "prefill", "kv_transfer", "decode") else "35%"
            lines.append(
                f"| {r.case.workload} | {r.case.level:.0%} | {r.mode} | {c.figure} | "
                f"{ms(c.predicted_s)} | {ms(c.measured_s)} | {ratio} | {bound} | "
                f"{'yes' if c.within else 'no'} |"
            )
    failed = sum(not x.ok for r in runs for x in r.records)
    leaked = sum(r.used_blocks_after for r in runs)
    lines += [
        "",
        f"Within the bound: {within} of {total} figures. Requests failed: {failed}; KV blocks "
        f"used or leased after the runs: {leaked}.",
        "",
        *acceptance(profile, runs),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = served_parser(__doc__, "planner")
    p.add_argument("--levels", default="0.4,0.8", help="loads, shares of 1P+1D's capacity")
    p.add_argument("--seconds", type=float, default=40.0, help="a mix run's arrival span")
    p.add_argument("--trace", default=str(SHARED_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--skip", type=int, default=3800, help="trace: start after this many")
    p.add_argument("--max-requests", type=int, default=60, help="trace: requests replayed")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    p.add_argument("--seed", type=int, default=0, help="the mixes' and simulator's seed")
    p.add_argument("--quick", action="store_true", help="8 requests a run, one level (0.5)")
    p.add_argument("--acceptance", action="store_true", help="the Mooncake slice only")
    a = p.parse_args(argv)
    a.levels = [0.5] if a.quick else [float(x) for x in a.levels.split(",")]
    a.quick_requests = 8 if a.quick else 0
    measured, wall_s = measure_served(a, lambda d, port: measure(a, d, port))
    return publish(render(a, argv, measured, wall_s), a.out)


if __name__ == "__main__":
    main()
