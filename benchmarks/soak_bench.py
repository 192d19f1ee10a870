"""A soak with kills: the Mooncake trace replayed on a 2 prefill x 2 decode app while a chaos
thread kills an engine replica every few seconds, as a crashed process.

    python -m benchmarks.soak_bench [--minutes 10] [--kill-every 60] [--time-scale 1.25]
        [--out FILE]

The trace (scaled; looped with new prompts each pass while the run lasts) is sent open loop,
EOS ignored, through Serve's gRPC proxy and the router's direct endpoint by turns, greedy and
seeded sampling by turns of two. Every `--kill-every` seconds, once both engine pools are whole,
one of their replicas is killed at random (`ray.kill`). Prints requests served, failed and
migrated, per path and sampling too; TTFT and ITL of those in flight during a kill against the
rest; KV blocks left once the load stops. The oracle: every token of every request served,
checked against transformers under the engine's greedy or seeded rule (engine/stream_oracle)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace

import grpc

from benchmarks import serve_session as session
from benchmarks.report import header, log, publish, served_parser
from benchmarks.trace_bench import SHARED_TRACE
from cluster.client import workload as wl
from cluster.client.bench_summary import BenchSummary, Distribution
from cluster.client.generation_client import app_metadata
from cluster.client.load_generator import PhaseTiming, RequestRecord, model_info
from cluster.config import ModelConfig
from cluster.engine.stream_oracle import StreamOracle
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.pb.pdserve.v1 import generation_pb2_grpc as pb_grpc
from cluster.sampling_params import SamplingParams
from cluster.serving.app_config import AppConfig

APP = "soak"
NUM_BLOCKS = 1024  # KV blocks per replica
ENGINES = {"Prefill": 2, "Decode": 2}  # deployment -> replicas
GROUPS = ("no kill in flight", "in flight during a kill", "migrated")
PATHS, KINDS = ("proxy", "direct"), ("greedy", "sampled")  # request i: i % 2, i // 2 % 2
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # and the request's index as its seed


@dataclass(frozen=True)
class Kill:
    at_s: float  # from the start of the replay
    deployment: str
    replica: str  # Serve's replica id (the actor name's last part)
    back_s: float = math.nan  # until the pool was whole again


@dataclass(eq=False)  # compared by identity
class Outcome:
    """One request as the client saw it, with the migrations its final message reported and
    when its stream ended (last token or error), seconds from the start of the replay."""

    record: RequestRecord
    migrations: int = 0
    ended_s: float = math.nan
    path: str = PATHS[0]
    kind: str = KINDS[0]

    def during(self, kill: Kill) -> bool:
        return self.record.sent_s <= kill.at_s <= self.ended_s


def looped_workload(
    entries: list[wl.TraceEntry], scale: wl.TraceScale, info, seconds: float, seed: int
) -> wl.Workload:
    """The scaled trace repeated until `seconds`, each pass with prompts of its own (seed +
    pass) one mean gap after the previous pass's last arrival."""
    out, offset = [], 0.0
    for k in itertools.count():
        work = wl.trace_workload(entries, scale, info.vocab_size, info.max_context_length, seed + k)
        out += [replace(r, arrival_s=r.arrival_s + offset) for r in work.requests]
        if out[-1].arrival_s >= seconds:
            break
        span = work.requests[-1].arrival_s
        offset += span + span / max(1, len(work.requests) - 1)
    kept = tuple(r for r in out if r.arrival_s < seconds)
    return wl.Workload(kept, f"{work.description}, looped for {seconds:g} s: {len(kept)} requests")


@dataclass(frozen=True)
class SoakSummary:
    outcomes: list[Outcome]
    kills: list[Kill]
    failures: dict[str, int]  # status code -> requests
    migrations: int
    migrated: int  # requests with at least one migration
    wrong_length: int  # served with another number of tokens than asked
    groups: dict[str, list[Outcome]]  # GROUPS -> the served requests in it
    in_flight: list[int]  # per kill: requests in flight

    @staticmethod
    def of(outcomes: list[Outcome], kills: list[Kill]) -> SoakSummary:
        served = [o for o in outcomes if o.record.ok]
        hit = [o for o in served if any(o.during(k) for k in kills)]
        return SoakSummary(
            outcomes, kills, dict(Counter(o.record.status for o in outcomes if not o.record.ok)),
            sum(o.migrations for o in served), sum(o.migrations > 0 for o in served),
            sum(o.record.output_tokens != o.record.max_tokens for o in served),
            {GROUPS[0]: [o for o in served if o not in hit], GROUPS[1]: hit,
             GROUPS[2]: [o for o in served if o.migrations]},
            [sum(o.during(k) for o in outcomes) for k in kills],
        )  # fmt: skip


def chaos(t0: float, every_s: float, until_s: float, seed: int, stop, kills: list[Kill]):
    """Kill an engine replica of app `APP`, drawn at random once both pools are whole, every
    `every_s` seconds after `t0` (perf_counter) until `until_s` or `stop`; append to `kills`."""
    import ray

    rng, tick = random.Random(seed), every_s
    while tick < until_s and not stop.wait(max(0.0, t0 + tick - time.perf_counter())):
        wait_whole(timeout_s=every_s, stop=stop)
        if stop.is_set() or time.perf_counter() - t0 >= until_s:
            return
        name = rng.choice(replica_names(deployment := rng.choice(sorted(ENGINES))))
        kill = Kill(time.perf_counter() - t0, deployment, name.rsplit("#", 1)[-1])
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        log(f"[{kill.at_s:6.1f} s] killed {deployment} replica {kill.replica}")
        back = wait_whole(timeout_s=300.0, stop=stop, gone=name)
        kills.append(replace(kill, back_s=back - t0 - kill.at_s) if back else kill)
        tick = max(tick + every_s, time.perf_counter() - t0)


def replica_names(deployment: str) -> list[str]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(n for n in names if f"{APP}#{deployment}#" in n)


def wait_whole(timeout_s: float, stop: threading.Event | None = None, gone: str = "") -> float:
    """Wait until every engine pool runs its replicas (and `gone` is no longer one of them);
    the `time.perf_counter()` it was so, or 0.0 at timeout or stop."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop and stop.is_set()):
        ds = serve.status().applications[APP].deployments
        if all(ds[d].replica_states.get("RUNNING", 0) == n == len(names := replica_names(d))
               and gone not in names for d, n in ENGINES.items()):  # fmt: skip
            return time.perf_counter()
        time.sleep(0.5)
    return 0.0


async def send(targets: dict[str, str], requests: dict[int, wl.WorkloadRequest], t0: float,
               timeout_s: float) -> list[Outcome]:  # fmt: skip
    """Each request sent at its arrival (seconds after `t0`) by its path (`targets`: path ->
    host:port), open loop; their outcomes in order."""
    async with contextlib.AsyncExitStack() as stack:
        enter, aio = stack.enter_async_context, grpc.aio.insecure_channel
        stubs = {p: pb_grpc.GenerationStub(await enter(aio(t))) for p, t in targets.items()}

        async def one(i: int, req: wl.WorkloadRequest) -> Outcome:
            rec = RequestRecord(i, req.arrival_s, len(req.prompt_token_ids), req.max_tokens)
            out = Outcome(rec, 0, math.nan, PATHS[i % 2], KINDS[i // 2 % 2])
            await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
            await stream(stubs[out.path], req, out, t0, timeout_s)
            return out

        return list(await asyncio.gather(*(one(i, r) for i, r in requests.items())))


async def stream(grpc_stub, req: wl.WorkloadRequest, out: Outcome, t0: float, timeout_s: float):
    """One `Generate` stream into `out`, as `cluster.client.load_generator` records it, plus
    the migrations and the time the stream ended; sampled ones seeded with their index."""
    rec = out.record
    sampling = pb.SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, **sampling_of(out))
    request = pb.GenerateRequest(prompt_token_ids=req.prompt_token_ids, sampling=sampling)
    rec.sent_s, last = time.perf_counter() - t0, None
    try:
        calls = grpc_stub.Generate(request, metadata=app_metadata(APP), timeout=timeout_s)
        async for msg in calls:
            rec.token_ids.extend(msg.token_ids)
            rec.token_times.extend(time.perf_counter() - t0 for _ in msg.token_ids)
            last = msg
    except grpc.aio.AioRpcError as e:
        rec.status, rec.error = e.code().name, e.details() or ""
    out.ended_s = time.perf_counter() - t0
    if rec.ok and (last is None or not rec.token_times):
        rec.status, rec.error = "UNKNOWN", "the stream ended without a token"
    elif rec.ok:
        rec.timing, out.migrations = PhaseTiming.of(last.timing), last.timing.migrations


def settled_replicas(proxy, timeout_s: float) -> tuple[list[pb.ReplicaStats], float]:
    """GetStats once every live engine replica has reported (the dead aged out) and none holds
    KV blocks or runs a sequence (stats come each second), or at timeout; and the seconds."""
    live = {n.rsplit("#", 1)[-1] for d in ENGINES for n in replica_names(d)}
    deadline = (began := time.monotonic()) + timeout_s
    time.sleep(1.3)
    while True:
        stats = proxy.GetStats(pb.GetStatsRequest(), metadata=app_metadata(APP))
        engines = [r for r in stats.replicas if r.pool in ("prefill", "decode")]
        idle = not any(r.kv_blocks_used or r.kv_blocks_leased or r.running for r in engines)
        if idle and {r.replica_id for r in engines} == live or time.monotonic() > deadline:
            return engines, time.monotonic() - began
        time.sleep(0.5)


def verify(model_dir: str, work: wl.Workload, s: SoakSummary) -> dict[int, str]:
    """The oracle on every request served: request index -> "exact", "boundary" or "wrong"."""
    oracle, served = StreamOracle(model_dir), [o for o in s.outcomes if o.record.ok]
    log(f"checking the {len(served)} requests served against transformers")
    return {o.record.index: oracle.check(work.requests[o.record.index].prompt_token_ids,
                                         o.record.token_ids, SamplingParams(**sampling_of(o)))
            for o in served}  # fmt: skip


def sampling_of(out: Outcome) -> dict:
    """How request `out` samples: greedy, or `SAMPLED` seeded with its index."""
    return {**SAMPLED, "seed": out.record.index} if out.kind == KINDS[1] else {"temperature": 0.0}


@dataclass
class SoakRun:
    work: wl.Workload
    summary: SoakSummary
    replicas: list[pb.ReplicaStats]
    settle_s: float
    checked: dict[int, str]  # request index -> the oracle's verdict
    kv_transport: str
    load_s: float


def measure(a: argparse.Namespace, model_dir: str, grpc_port: int) -> SoakRun:
    import ray
    from ray import serve

    if not ray.is_initialized():  # --grpc-port: someone else's Ray, on this node
        ray.init(address="auto", logging_level="warning")
    proxy, pool = session.stub(grpc_port), session.small_pool(NUM_BLOCKS, 32)
    engines = {d.lower(): replace(pool, replicas=n) for d, n in ENGINES.items()}
    config = AppConfig(ModelConfig(model_dir), router=pool, name=APP, **engines)
    with session.deployed([config]):
        session.wait_ready(proxy, APP, list(range(16, 48)))
        router = serve.get_deployment_handle("Router", app_name=APP)
        to = {"proxy": f"127.0.0.1:{grpc_port}", "direct": router.grpc_endpoint.remote().result()}
        session.wait_ready(pb_grpc.GenerationStub(grpc.insecure_channel(to["direct"])), APP, [16])
        info, scale = asyncio.run(model_info(to["proxy"], APP)), wl.TraceScale(time=a.time_scale)
        work = looped_workload(wl.load_trace(a.trace), scale, info, a.minutes * 60, 0)
        log(f"soak: {work.description}, a kill every {a.kill_every:g} s")
        t0, stop, kills = time.perf_counter() + 1.0, threading.Event(), []
        args = (t0, a.kill_every, a.minutes * 60, 0, stop, kills)
        (killer := threading.Thread(target=chaos, args=args, name="chaos", daemon=True)).start()
        outcomes = asyncio.run(send(to, dict(enumerate(work.requests)), t0, 300.0))
        load_s = time.perf_counter() - t0
        stop.set()
        killer.join()
        log("load stopped; waiting for the pools and their KV blocks to settle")
        wait_whole(timeout_s=300.0)
        settled = settled_replicas(proxy, 60.0)
        checked = verify(model_dir, work, summary := SoakSummary.of(outcomes, kills))
    return SoakRun(work, summary, *settled, checked, session.kv_transport(config), load_s)


def table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(map(str, r)) + " |" for r in [head, *rows]]
    return [lines[0], "|" + "---|" * len(head), *lines[1:]]


def split_rows(s: SoakSummary, checked: dict[int, str]) -> list[str]:
    """Requests served, failed and migrated by path and sampling, and the oracle's counts."""

    def row(name: str, outs: list[Outcome]) -> list:
        ok = [o for o in outs if o.record.ok]
        verdicts = Counter(checked.get(o.record.index) for o in ok)
        hit = sum(any(o.during(k) for k in s.kills) for o in outs)
        return [name, len(outs), len(ok), len(outs) - len(ok), sum(o.migrations > 0 for o in ok),
                hit, verdicts["exact"], verdicts["boundary"], verdicts["wrong"]]  # fmt: skip

    by = [(f"{p}, {k}", [o for o in s.outcomes if (o.path, o.kind) == (p, k)])
          for p, k in itertools.product(PATHS, KINDS)]  # fmt: skip
    return table(["path, sampling", "sent", "served", "failed", "migrated",
                  "in flight during a kill", "exact", "at a boundary", "wrong"],
                 [row(*x) for x in [*by, ("all", s.outcomes)]])  # fmt: skip


def by_pool(records: list[RequestRecord]) -> tuple[list[RequestRecord], int]:
    """The records, with "" for decode replicas that are prefill ones (the router names the last
    token's hop: a prefill when one token was asked or a migration's prefill gave the last),
    and how many those are."""
    prefill = {r.timing.prefill_replica for r in records if r.timing}
    wrong = [bool(r.timing and r.timing.decode_replica in prefill) for r in records]
    return [replace(r, timing=replace(r.timing, decode_replica="")) if w else r
            for r, w in zip(records, wrong, strict=True)], sum(wrong)  # fmt: skip


def latency_rows(s: SoakSummary) -> list[str]:
    ttft = {g: Distribution.of([o.record.ttft_s for o in s.groups[g]]) for g in GROUPS}
    gaps = {g: [x for o in s.groups[g] for x in o.record.itl_s] for g in GROUPS}
    itl = {g: Distribution.of(gaps[g]) for g in GROUPS}

    def pct(d: Distribution) -> str:
        return " / ".join(f"{d.pct[p] * 1e3:,.0f}" if d.n else "-" for p in (50, 99))

    rows = table(["", *GROUPS], [
        ["requests", *(len(s.groups[g]) for g in GROUPS)],
        ["TTFT p50 / p99 (ms)", *(pct(ttft[g]) for g in GROUPS)],
        ["ITL p50 / p99 (ms)", *(pct(itl[g]) for g in GROUPS)],
        ["longest gap (ms)", *(f"{max(gaps[g]) * 1e3:,.0f}" if gaps[g] else "-" for g in GROUPS)],
    ])  # fmt: skip
    calm, hit = GROUPS[:2]
    if ttft[calm].n and ttft[hit].n:
        cost = [f"{name} p{p} {(d[hit].pct[p] - d[calm].pct[p]) * 1e3:+,.0f} ms"
                for name, d in (("TTFT", ttft), ("ITL", itl)) for p in (50, 99)]  # fmt: skip
        rows += ["", "Latency cost of a kill (in flight during one against none): "
                 + ", ".join(cost) + "."]  # fmt: skip
    return rows


def render(a: argparse.Namespace, argv: list[str], run: SoakRun, wall_s: float) -> str:
    s, leaked = run.summary, sum(r.kv_blocks_used + r.kv_blocks_leased for r in run.replicas)
    failed = ", ".join(f"{k} {v}" for k, v in sorted(s.failures.items())) or "none"
    verdicts = Counter(run.checked.values())
    records, misnamed = by_pool([o.record for o in s.outcomes])
    title = "pdserve soak: the trace replayed while engine replicas are killed"
    lines = [
        *header(title, "soak_bench", argv),
        f"- wall time {wall_s:.0f} s; load for {run.load_s:.0f} s; {run.work.description}",
        f"- app: 1 router, 2 prefill x 2 decode replicas of one torch thread, {NUM_BLOCKS} KV "
        f"blocks of 16 tokens each, KV transport {run.kv_transport}; {a.preset} model",
        "- by turns through Serve's gRPC proxy and the router's direct endpoint; greedy and "
        f"sampled ({', '.join(f'{k} {v}' for k, v in SAMPLED.items())}, a seed each) by twos",
        "",
        f"**Requests: {len(s.outcomes)} sent, {len(s.outcomes) - sum(s.failures.values())} "
        f"served, failed: {failed}.** Migrations: {s.migrations} over {s.migrated} requests. "
        f"Served with another number of tokens than asked: {s.wrong_length}.",
        f"**KV blocks used or leased after the load, over every engine replica: {leaked}** "
        f"(settled in {run.settle_s:.1f} s).",
        f"**Every token of the {len(run.checked)} requests served against transformers: "
        f"{verdicts['exact']} exact, {verdicts['wrong']} wrong**, {verdicts['boundary']} with a "
        "token where two are within 1e-3 of each other (engine/stream_oracle.py).",
        "",
        *split_rows(s, run.checked),
        "",
        *latency_rows(s),
        "",
        f"## {len(s.kills)} kills",
        "",
        *table(["at (s)", "replica killed", "requests in flight", "pool whole again after (s)"],
               [[f"{k.at_s:.1f}", f"{k.deployment} {k.replica}", m, f"{k.back_s:.1f}"]
                for k, m in zip(s.kills, s.in_flight, strict=True)]),
        "",
        "## Engine replicas after the load",
        "",
        *table(["pool", "replica", "KV blocks used", "leased", "running", "waiting"],
               [[r.pool, r.replica_id, r.kv_blocks_used, r.kv_blocks_leased, r.running,
                 r.waiting] for r in run.replicas]),
        *failures(s),
        "",
        "## All requests",
        "",
        f"Replicas by their pool: {misnamed} requests name a prefill replica as their decode "
        "one (counted as decode `?`, with those served by prefill alone).",
        *BenchSummary.of(records).render(),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def failures(s: SoakSummary, limit: int = 20) -> list[str]:
    """The failed requests (up to `limit`): how sent, code, details, tokens, kills in flight."""
    bad = [o for o in s.outcomes if not o.record.ok]
    return ["", f"## Failed requests ({len(bad)})", ""] * bool(bad) + [
        f"- request {r.index} ({o.path}, {o.kind}), {r.sent_s:.1f}-{o.ended_s:.1f} s: {r.status} "
        f"{r.error!r} after {r.output_tokens} of {r.max_tokens} tokens; kills: "
        f"{', '.join(f'{k.deployment} at {k.at_s:.1f} s' for k in s.kills if o.during(k))}"
        for o, r in ((o, o.record) for o in bad[:limit])
    ]


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = served_parser(__doc__, "soak", preset="tiny")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the trace is sent")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--trace", default=str(SHARED_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--time-scale", type=float, default=1.25)
    a = p.parse_args(argv)
    run, wall_s = session.measure_served(a, lambda model_dir, port: measure(a, model_dir, port))
    return publish(render(a, argv, run, wall_s), a.out)


if __name__ == "__main__":
    main()
