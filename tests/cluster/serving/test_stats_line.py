"""An engine replica's stats line: vLLM's fields and wording, throughputs over the interval,
written while the engine has work and once after, never while it stays idle."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.serving.metered_engine import EngineTotals
from cluster.serving.pool_messages import ReplicaStats
from cluster.serving.stats_line import STATS_LOG_INTERVAL_S, StatsLine, format_stats_line

BUSY = ReplicaStats("prefill", "p0", 200, 50, 10, running=3, waiting=2, queued_prompt_tokens=0)
IDLE = replace(BUSY, kv_blocks_used=0, kv_blocks_leased=0, running=0, waiting=0)


def test_the_line_has_vllms_fields_in_its_order():
    line = format_stats_line("decode", 1234.56, 78.91, BUSY, 0.4)
    assert line == (
        "decode engine: Avg prompt throughput: 1234.6 tokens/s, "
        "Avg generation throughput: 78.9 tokens/s, Running: 3 reqs, Waiting: 2 reqs, "
        "KV cache usage: 25.0%, Prefix cache hit rate: 40.0%"
    )


def test_throughputs_are_the_intervals_and_prompt_throughput_counts_computed_tokens():
    line = StatsLine("prefill", EngineTotals(100.0, 1000, 400, 50))
    # 10 s: 800 prompt tokens, 200 of them cached; 30 tokens sampled.
    got = line.next(EngineTotals(110.0, 1800, 600, 80), BUSY)
    assert got == format_stats_line("prefill", 60.0, 3.0, BUSY, 0.25)


def test_an_idle_engine_writes_one_more_line_then_none():
    line = StatsLine("colocated", EngineTotals(0.0))
    assert line.next(EngineTotals(10.0), IDLE) is None  # idle from the start
    assert line.next(EngineTotals(20.0, 100, 60, 10), IDLE) is not None
    # Idle after work: one more line (throughputs 0), the hit rate still the last one seen.
    assert line.next(EngineTotals(30.0, 100, 60, 10), IDLE) == format_stats_line(
        "colocated", 0.0, 0.0, IDLE, 0.6
    )
    assert line.next(EngineTotals(40.0, 100, 60, 10), IDLE) is None


def test_sequences_still_running_or_waiting_count_as_work():
    line = StatsLine("decode", EngineTotals(0.0))
    stuck = replace(IDLE, waiting=1)
    assert line.next(EngineTotals(10.0), stuck) == format_stats_line("decode", 0, 0, stuck, 0)


@pytest.mark.parametrize("elapsed", [STATS_LOG_INTERVAL_S - 0.01, STATS_LOG_INTERVAL_S])
def test_a_line_is_due_every_interval(elapsed):
    line = StatsLine("decode", EngineTotals(5.0))
    assert line.due(5.0 + elapsed) is (elapsed >= STATS_LOG_INTERVAL_S)
