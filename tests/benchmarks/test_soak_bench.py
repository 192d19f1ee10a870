"""The soak benchmark's own logic, without Ray: the trace looped for the run's length, requests
split by whether a kill happened while they were in flight, and the report's figures."""

from __future__ import annotations

import argparse

from benchmarks.soak_bench import (
    GROUPS,
    Kill,
    Outcome,
    SoakRun,
    SoakSummary,
    looped_workload,
    render,
)
from cluster.client.load_generator import PhaseTiming, RequestRecord
from cluster.client.workload import TraceEntry, TraceScale, Workload
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.benchmarks.bench_report import cells

INFO = pb.ModelInfo(vocab_size=4096, max_context_length=2048)


def test_the_trace_is_looped_with_new_prompts_until_the_run_ends() -> None:
    entries = [TraceEntry(t, 1024, 8, (0, 1)) for t in (0.0, 1000.0, 2000.0)]
    work = looped_workload(entries, TraceScale(1 / 32, 1.0), INFO, seconds=7.5, seed=0)

    arrivals = [r.arrival_s for r in work.requests]
    # a pass starts one mean gap (1 s) after the previous one's last arrival: at 0, 3 and 6 s
    assert arrivals == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    first, second = work.requests[0].prompt_token_ids, work.requests[3].prompt_token_ids
    assert first != second and len(first) == len(second) == 32
    assert work.requests[1].prompt_token_ids == first  # shared hash ids within a pass
    assert "8 requests" in work.description


def outcome(sent: float, ended: float, migrations: int = 0, status: str = "OK") -> Outcome:
    rec = RequestRecord(0, sent, 16, 3, sent_s=sent, status=status)
    if status == "OK":
        rec.token_ids, rec.token_times = [5, 6, 7], [sent + 0.1, sent + 0.2, ended]
        rec.timing = PhaseTiming(0.0, 0.05, 0.0, 0.1, ended - sent - 0.1, ended - sent, "p", "d")
    return Outcome(rec, migrations, ended)


def test_requests_are_split_by_the_kills_they_were_in_flight_for() -> None:
    calm, hit, moved = outcome(0.0, 1.0), outcome(1.5, 3.0), outcome(1.0, 5.0, migrations=2)
    failed = outcome(4.5, 4.7, status="UNAVAILABLE")
    kills = [Kill(2.0, "Decode", "abc", 9.0), Kill(4.6, "Prefill", "def")]
    s = SoakSummary.of([calm, hit, moved, failed], kills)

    assert s.groups == {GROUPS[0]: [calm], GROUPS[1]: [hit, moved], GROUPS[2]: [moved]}
    assert s.failures == {"UNAVAILABLE": 1}
    assert (s.migrations, s.migrated, s.wrong_length) == (2, 1, 0)
    assert s.in_flight == [2, 2]  # the failed one counts where it was in flight
    assert len(s.gaps(GROUPS[1])) == 4


def test_the_report_prints_failures_migrations_the_cost_of_a_kill_and_leaks() -> None:
    outcomes = [outcome(0.0, 1.0), outcome(1.5, 3.0), outcome(1.0, 5.0, 1)]
    outcomes.append(outcome(4.5, 4.7, status="UNAVAILABLE"))
    outcomes[3].record.error = "no replica"
    s = SoakSummary.of(outcomes, [Kill(2.0, "Decode", "abc", 9.0), Kill(4.6, "Prefill", "d")])
    replicas = [
        pb.ReplicaStats(pool="decode", replica_id="r1", kv_blocks_used=2),
        pb.ReplicaStats(pool="prefill", replica_id="r2", kv_blocks_leased=1),
    ]
    run = SoakRun(Workload((), "a trace"), s, replicas, 1.5, (2, 0), "grpc", 5.0)
    a = argparse.Namespace(num_blocks=64, preset="tiny")

    report = render(a, ["--minutes", "1"], run, 12.0)

    assert "4 sent, 3 served, failed: UNAVAILABLE 1." in report
    assert "Migrations: 1 over 1 requests" in report
    assert "every engine replica: 3**" in report
    assert "Same tokens when sent again with nothing killed: 2 of 2" in report
    assert cells(report, "requests") == ["1", "2", "1"]
    assert "Latency cost of a kill" in report
    assert cells(report, "2.0") == ["Decode abc", "2", "9.0"]
    assert cells(report, "decode") == ["r1", "2", "0", "0", "0"]
    assert "UNAVAILABLE 'no replica' after 0 of 3 tokens; kills: Prefill at 4.6 s" in report
