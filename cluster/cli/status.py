"""`pdserve status`: a running cluster's pools (replicas now and targeted, bounds, load), its
engine replicas (device and dtype as each decided them, tensor parallel size, KV blocks,
sequences, queued prompt tokens, tokens generated; "loading" while one's engine starts, a hub
model downloading into its node's cache), where each replica's ranks run (node and pid) and its
router replicas (their direct gRPC endpoints), as four tables, and the ratio policy's split and
its latest changes when the app runs one; or, with `--json`, as one JSON object; `--watch`
refreshes until Ctrl-C."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from cluster.client.generation_client import GenerationClient
from cluster.pb.pdserve.v1 import generation_pb2 as pb

ROUTER_POOL = "router"  # GetStats lists router replicas under this pool, with no KV figures
CLEAR_SCREEN = "\x1b[H\x1b[2J"
WATCH_EVERY_S = 2.0


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:9000", help="gRPC address of a cluster")
    p.add_argument(
        "--application",
        default=None,
        help="Serve application, when Serve runs several (default: the only one)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: model, kv_transport, pools, replicas (with --watch: one "
        "per line)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=WATCH_EVERY_S,
        default=None,
        metavar="SECONDS",
        help=f"refresh every SECONDS ({WATCH_EVERY_S:g} if not given) until Ctrl-C "
        "(default: print once)",
    )


@dataclass(frozen=True)
class Snapshot:
    """One look at a cluster: its model and its stats, and when they were read."""

    info: pb.ModelInfo
    stats: pb.ClusterStats
    at: datetime


def fetch(target: str, application: str | None) -> Snapshot:
    """Read a cluster's `GetModelInfo` and `GetStats` (raises `grpc.RpcError`)."""
    with GenerationClient(target, application) as client:
        return Snapshot(client.model_info(), client.stats(), datetime.now(UTC))


def status_main(args: argparse.Namespace) -> int:
    if args.watch is not None and not args.watch > 0:
        raise SystemExit("--watch must be > 0 seconds")
    return show_status(lambda: fetch(args.target, args.application), args.json, args.watch)


def show_status(
    read: Callable[[], Snapshot],
    as_json: bool,
    watch: float | None,
    out: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Print `read()` once, or every `watch` seconds until Ctrl-C. A failed read is reported
    on stderr: once, it ends the command (exit status 2); watching, the next read retries."""
    out = out or sys.stdout
    try:
        while True:
            try:
                snapshot = read()
            except grpc.RpcError as e:
                print(f"error ({e.code().name}): {e.details()}", file=sys.stderr, flush=True)
                if watch is None:
                    return 2
            else:
                if as_json:
                    out.write(json.dumps(status_json(snapshot), allow_nan=False) + "\n")
                else:
                    lines = render(snapshot)
                    if watch is not None:
                        lines = [_watch_header(snapshot, watch, out), *lines]
                    out.write("\n".join(lines) + "\n")
                out.flush()
            if watch is None:
                return 0
            sleep(watch)
    except KeyboardInterrupt:
        return 0


def status_json(snapshot: Snapshot) -> dict[str, Any]:
    """The snapshot as plain JSON types: `time` (ISO 8601, UTC), `model` (`ModelInfo`) and
    `ClusterStats`' `kv_transport`, `pools` and `replicas` (router replicas included, pool
    "router", with their `grpc_endpoint`), with the proto field names; every field present,
    integers as numbers."""

    def plain(message) -> dict[str, Any]:
        return MessageToDict(
            message,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
            unquote_int64_if_possible=True,
        )

    return {
        "time": snapshot.at.isoformat(timespec="milliseconds"),
        "model": plain(snapshot.info),
        **plain(snapshot.stats),
    }


def render(snapshot: Snapshot) -> list[str]:
    """The tables, as lines: pools, engine replicas, their ranks' nodes and pids when any is
    listed, and the routers when any is listed."""
    info, stats = snapshot.info, snapshot.stats
    transport = f"  kv transport {stats.kv_transport}" if stats.kv_transport else ""
    lines = [f"model {info.model_id}  mode {info.mode}  block_size {info.block_size}{transport}"]
    lines += [""] + _table(
        ("pool", "deployment", "replicas", "target", "min..max", "load (total / target each)"),
        [
            (
                p.pool,
                p.deployment,
                p.current_replicas,
                p.target_replicas,
                f"{p.min_replicas}..{p.max_replicas}",
                ", ".join(f"{g.name} {g.value:g} / {g.target_per_replica:g}" for g in p.signals),
            )
            for p in stats.pools
        ],
    )
    header = ("pool", "replica", "device", "dtype", "tp", "kv total", "kv used", "kv leased")
    header += ("kv cached", "running", "waiting", "queued", "generated", "state")
    rows = [
        (
            r.pool,
            r.replica_id,
            r.device or "-",
            r.dtype or "-",
            r.tensor_parallel_size or "-",  # 0: a server from before the field
            r.kv_blocks_total,
            r.kv_blocks_used,
            r.kv_blocks_leased,
            r.kv_blocks_cached,
            r.running,
            r.waiting,
            r.queued_prompt_tokens,
            r.generated_tokens,
            r.state or "ready",  # a server from before the field lists ready replicas only
        )
        for r in stats.replicas
        if r.pool != ROUTER_POOL
    ]
    lines += [""] + _table(header, rows)
    ranks = [
        (r.replica_id, p.rank, p.node_ip or "-", p.pid, p.node_id or "-")
        for r in stats.replicas
        if r.pool != ROUTER_POOL
        for p in r.ranks  # none while loading, nor from a server from before the field
    ]
    if ranks:
        lines += [""] + _table(("replica", "rank", "node ip", "pid", "node id"), ranks)
    if stats.HasField("ratio_policy"):
        lines += [""] + ratio_policy_lines(stats.ratio_policy)
    routers = [
        (r.replica_id, r.grpc_endpoint or "off") for r in stats.replicas if r.pool == ROUTER_POOL
    ]
    if routers:
        lines += [""] + _table(("router", "direct grpc endpoint"), routers)
    return lines


def ratio_policy_lines(status: pb.RatioPolicyStatus) -> list[str]:
    """The ratio policy's split now (or why the pools scale on their own signals), then its
    latest changes, each with the mix it was simulated on and the goodput it predicts."""
    if status.HasField("current"):
        d = status.current
        head = [
            f"ratio policy: {_split(d)} for prompts ~{d.mean_input_tokens} and outputs "
            f"~{d.mean_output_tokens} tokens at {d.rate_rps:.2f} req/s, predicted goodput "
            f"{d.goodput_rps:.2f} req/s ({d.attainment:.0%} within the SLOs)"
        ]
    else:
        head = [f"ratio policy: no split, {status.reason}"]
    rows = [
        (
            datetime.fromtimestamp(d.decided_at, UTC).astimezone().strftime("%H:%M:%S"),
            _split(d),
            d.mean_input_tokens,
            d.mean_output_tokens,
            f"{d.rate_rps:.2f}",
            f"{d.goodput_rps:.2f}",
            f"{d.attainment:.0%}",
        )
        for d in status.history
    ]
    header = ("decided", "split", "prompt", "output", "req/s", "goodput", "attainment")
    return head + (_table(header, rows) if rows else [])


def _split(d: pb.SplitDecision) -> str:
    return f"{d.prefill_replicas}P:{d.decode_replicas}D"


def _watch_header(snapshot: Snapshot, every_s: float, out: TextIO) -> str:
    """On a terminal the screen is cleared first; into a file or pipe, snapshots follow."""
    clear = CLEAR_SCREEN if out.isatty() else "\n"
    when = snapshot.at.astimezone().strftime("%H:%M:%S")
    return f"{clear}{when}  every {every_s:g}s, Ctrl-C to stop\n"


def _table(header: tuple, rows: list[tuple]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    return [
        "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
