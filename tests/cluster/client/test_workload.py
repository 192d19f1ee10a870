from __future__ import annotations

import json
import math

import pytest

from cluster.client.workload import (
    FIRST_TOKEN,
    TraceEntry,
    TraceScale,
    load_trace,
    synthetic_workload,
    trace_workload,
)
from tests.traces import write_trace

VOCAB = 1000


def row(ts: float, n_in: int, n_out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def test_load_trace_reads_skips_and_limits(tmp_path):
    rows = [(i * 100, 600, 5 + i, [i, i + 10]) for i in range(5)]
    f = write_trace(tmp_path / "t.jsonl", rows)
    assert [e.output_length for e in load_trace(f)] == [5, 6, 7, 8, 9]
    got = load_trace(f, limit=2, skip=1)
    assert got == [TraceEntry(100.0, 600, 6, (1, 11)), TraceEntry(200.0, 600, 7, (2, 12))]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        (json.dumps(row(-1, 5, 1, [0])), "timestamp must be a number >= 0"),
        (json.dumps(row(0, 0, 1, [])), "input_length must be an integer >= 1"),
        (json.dumps(row(0, 5, True, [0])), "output_length must be an integer >= 1"),
        (json.dumps(row(0, 5, 1, ["a"])), "hash_ids must be a list of integers"),
        (json.dumps(row(0, 1025, 1, [0, 1])), "2 hash_ids for 1025 input tokens"),
    ],
)
def test_a_bad_trace_line_is_refused_with_its_line_number(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(row(0, 5, 1, [0])) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as e:
        load_trace(f)
    assert f"{f}:2" in str(e.value)


def test_an_empty_trace_is_refused(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(f)


def test_equal_leading_hash_ids_give_token_identical_prefixes():
    entries = [
        TraceEntry(1000, 1536, 10, (1, 2, 3)),
        TraceEntry(1500, 1300, 20, (1, 2, 4)),  # shares two blocks, then its own
        TraceEntry(3000, 1024, 30, (5, 2)),  # block 2 again, but after another first block
        TraceEntry(3500, 512, 40, (1,)),
    ]
    w = trace_workload(entries, TraceScale(length=1 / 32, time=2.0, output=0.5), VOCAB, 4096)
    a, b, c, d = w.requests
    assert [len(r.prompt_token_ids) for r in w.requests] == [48, 41, 32, 16]
    assert a.prompt_token_ids[:32] == b.prompt_token_ids[:32]
    assert a.prompt_token_ids[32:48] != b.prompt_token_ids[32:48]
    assert c.prompt_token_ids[16:32] == a.prompt_token_ids[16:32]  # same id, same tokens
    assert d.prompt_token_ids == a.prompt_token_ids[:16]
    # Reusable: only a leading run of blocks that came before counts.
    assert [r.reusable_tokens for r in w.requests] == [0, 32, 0, 16]
    assert w.reusable_tokens == 48 and w.prompt_tokens == 137
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 4.0, 5.0]
    assert [r.max_tokens for r in w.requests] == [5, 10, 15, 20]
    assert all(FIRST_TOKEN <= t < VOCAB for r in w.requests for t in r.prompt_token_ids)
    assert "16 tokens per trace block" in w.description and "clock x 2" in w.description


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others():
    entries = [TraceEntry(0, 1024, 4, (7, 8))]
    one = trace_workload(entries, TraceScale(), VOCAB, 4096, seed=1)
    assert one == trace_workload(entries, TraceScale(), VOCAB, 4096, seed=1)
    assert one.requests[0].prompt_token_ids != (
        trace_workload(entries, TraceScale(), VOCAB, 4096, seed=2).requests[0].prompt_token_ids
    )


def test_prompts_are_cut_to_leave_room_for_the_output():
    entries = [TraceEntry(0, 512 * 8, 100, tuple(range(8))), TraceEntry(5, 512, 10, (0,))]
    w = trace_workload(entries, TraceScale(length=1 / 8), VOCAB, max_context=300)
    long, short = w.requests
    assert len(long.prompt_token_ids) == 200 and long.max_tokens == 100 and long.clipped
    assert not short.clipped and short.reusable_tokens == 64


def test_a_scale_without_whole_blocks_pads_with_tokens_of_its_own():
    # 0.02 x 512 = 10.24: ten tokens a block; 1536 x 0.02 = 30.72 -> 31 tokens, one padded.
    entries = [TraceEntry(0, 1536, 1, (1, 2, 3)), TraceEntry(1, 1536, 1, (1, 2, 3))]
    w = trace_workload(entries, TraceScale(length=0.02), VOCAB, 4096)
    a, b = w.requests
    assert len(a.prompt_token_ids) == 31 and a.prompt_token_ids[:30] == b.prompt_token_ids[:30]
    assert b.reusable_tokens == 30


@pytest.mark.parametrize("field", ["length", "time", "output"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_a_scale_must_be_positive_and_finite(field, value):
    with pytest.raises(ValueError, match=f"trace scale {field}"):
        TraceScale(**{field: value})


def test_synthetic_poisson_arrivals_at_the_asked_rate():
    w = synthetic_workload(2000, 8, 4, VOCAB, rate=50.0, seed=3)
    times = [r.arrival_s for r in w.requests]
    assert times[0] == 0.0 and times == sorted(times)
    assert (len(times) - 1) / times[-1] == pytest.approx(50.0, rel=0.1)
    assert {len(r.prompt_token_ids) for r in w.requests} == {8}
    assert {r.max_tokens for r in w.requests} == {4}
    assert len({r.prompt_token_ids for r in w.requests}) == 2000  # nothing shared
    assert "Poisson arrivals at 50 requests/s" in w.description


def test_synthetic_all_at_once_and_bad_arguments():
    assert {r.arrival_s for r in synthetic_workload(5, 8, 4, VOCAB).requests} == {0.0}
    for args in [(0, 8, 4), (1, 0, 4), (1, 8, 0)]:
        with pytest.raises(ValueError, match="must be >= 1"):
            synthetic_workload(*args, VOCAB)
    with pytest.raises(ValueError, match="rate"):
        synthetic_workload(1, 8, 4, VOCAB, rate=0.0)
    with pytest.raises(ValueError, match="too small"):
        synthetic_workload(1, 8, 4, FIRST_TOKEN)
