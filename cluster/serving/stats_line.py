"""`StatsLine`: an engine replica's periodic summary in its log, vLLM's "Avg prompt throughput:
... Running: N reqs ..." line, every STATS_LOG_INTERVAL_S while the engine has work and once
more after it runs out, so an idle replica's log stays quiet."""

from __future__ import annotations

from cluster.serving.metered_engine import EngineTotals
from cluster.serving.pool_messages import ReplicaStats

STATS_LOG_INTERVAL_S = 10.0


def format_stats_line(
    pool: str,
    prompt_throughput: float,
    generation_throughput: float,
    stats: ReplicaStats,
    prefix_hit_rate: float,
) -> str:
    """vLLM's line, its fields in its order ("KV cache", not "GPU KV cache": pdserve also runs
    on CPUs); throughputs in tokens/s, the prompt's counting computed tokens only."""
    usage = stats.kv_blocks_used / max(1, stats.kv_blocks_total)
    return (
        f"{pool} engine: Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
        f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
        f"Running: {stats.running} reqs, Waiting: {stats.waiting} reqs, "
        f"KV cache usage: {usage * 100:.1f}%, Prefix cache hit rate: {prefix_hit_rate * 100:.1f}%"
    )


class StatsLine:
    """The line of each interval between calls to `next`. The prefix cache hit rate is that of
    the latest interval that prefilled prompts (cached prompt tokens / prompt tokens)."""

    def __init__(self, pool: str, start: EngineTotals) -> None:
        self.pool = pool
        self._last = start
        self._had_work = False
        self._hit_rate = 0.0

    def due(self, now: float) -> bool:
        return now - self._last.at >= STATS_LOG_INTERVAL_S

    def next(self, totals: EngineTotals, stats: ReplicaStats) -> str | None:
        """The line for the interval since the last call; None when neither it nor the one
        before had work (no token in or out, nothing running or waiting at the end)."""
        last, self._last = self._last, totals
        seconds = max(totals.at - last.at, 1e-9)
        prompt = totals.prompt_tokens - last.prompt_tokens
        cached = totals.cached_prompt_tokens - last.cached_prompt_tokens
        generated = totals.generated_tokens - last.generated_tokens
        if prompt:
            self._hit_rate = cached / prompt
        had_work = bool(prompt or generated or stats.running or stats.waiting)
        report = had_work or self._had_work
        self._had_work = had_work
        if not report:
            return None
        return format_stats_line(
            self.pool, (prompt - cached) / seconds, generated / seconds, stats, self._hit_rate
        )
