"""Which prefill rank holds which KV heads, and which of them each decode rank reads from
which prefill rank, between tensor-parallel groups of different sizes (every transport that
moves KV between TP sizes plans with these: `grpc.tp_ranks`, `nixl.nixl_ranks`).

A rank `r` of a TP `k` pool of a model with `T` KV heads holds heads `[r·T/k, r·T/k + T/k)`,
or, when `T < k`, the one head `⌊r·T/k⌋` (replicated, as `TPShard` splits the model). A decode
rank needs exactly its own heads: `head_plan` cuts them into runs, each held whole by one
prefill rank (of the ranks holding a replicated head, the one of the decode rank's index, so
the reads spread).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cluster.engine.kv_cache import KVLayout
from cluster.errors import FailedPrecondition
from cluster.kv_transfer.kv_handle import KVHandle


def rank_heads(total_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads rank `rank` of a TP `tp_size` pool holds."""
    if total_kv_heads % tp_size and tp_size % total_kv_heads:
        raise FailedPrecondition(f"{total_kv_heads} KV heads do not split over TP {tp_size}")
    start = rank * total_kv_heads // tp_size
    return range(start, start + max(1, total_kv_heads // tp_size))


@dataclass(frozen=True)
class HeadRun:
    """Heads `[start, start + count)` of the model, read from prefill rank `rank` into this
    pool's heads from `offset`."""

    rank: int
    start: int
    count: int
    offset: int


def head_plan(source: KVLayout, dest: KVLayout) -> list[HeadRun]:
    """How the decode rank whose pool is `dest` gets its heads from the prefill pools of
    `source`'s replica (`source`: its rank 0's layout). FailedPrecondition if the two are not
    the same model's KV or the heads do not split."""
    if not source.same_model(dest):
        raise FailedPrecondition(
            f"KV layouts differ beyond their TP size and heads (prefill {source}, decode {dest})"
        )
    k, dest_rank = source.tp_size, dest.kv_head_start * dest.tp_size // dest.total_kv_heads
    owners = [rank_heads(source.total_kv_heads, k, r) for r in range(k)]
    runs: list[HeadRun] = []
    for h in range(dest.kv_head_start, dest.head_end):
        holders = [r for r in range(k) if h in owners[r]]
        rank = holders[dest_rank % len(holders)]
        last = runs[-1] if runs else None
        if last is not None and last.rank == rank and last.start + last.count == h:
            runs[-1] = HeadRun(rank, last.start, last.count + 1, last.offset)
        else:
            runs.append(HeadRun(rank, h, 1, h - dest.kv_head_start))
    return runs


def source_layout(handle: KVHandle, rank: int) -> KVLayout:
    """The layout of prefill rank `rank`'s pool, from its rank 0's (the handle's)."""
    heads = rank_heads(handle.layout.total_kv_heads, handle.layout.tp_size, rank)
    return replace(handle.layout, kv_head_start=heads.start, num_kv_heads=len(heads))
