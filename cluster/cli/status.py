"""`pdserve status`: a running cluster's pools (replicas now and targeted, bounds, load) and its
replicas (KV blocks, sequences, queued prompt tokens, tokens generated), as two tables."""

from __future__ import annotations

import sys

import grpc

from cluster.client.generation_client import GenerationClient


def status_main(target: str, application: str | None = None) -> int:
    try:
        with GenerationClient(target, application) as client:
            info = client.model_info()
            stats = client.stats()
    except grpc.RpcError as e:
        print(f"error ({e.code().name}): {e.details()}", file=sys.stderr)
        return 2
    transport = f"  kv transport {stats.kv_transport}" if stats.kv_transport else ""
    print(f"model {info.model_id}  mode {info.mode}  block_size {info.block_size}{transport}\n")
    _table(
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
    print()
    header = (
        "pool",
        "replica",
        "kv total",
        "kv used",
        "kv leased",
        "kv cached",
        "running",
        "waiting",
        "queued",
        "generated",
    )
    rows = [
        (
            r.pool,
            r.replica_id,
            r.kv_blocks_total,
            r.kv_blocks_used,
            r.kv_blocks_leased,
            r.kv_blocks_cached,
            r.running,
            r.waiting,
            r.queued_prompt_tokens,
            r.generated_tokens,
        )
        for r in stats.replicas
    ]
    _table(header, rows)
    return 0


def _table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)))
