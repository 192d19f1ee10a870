"""The soak benchmark's own logic, without Ray: the trace looped for the run's length, requests
sent by turns through both paths greedy and sampled, split by whether a kill happened while they
were in flight, the oracle's choice of requests to send again, and the report's figures."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import replace

import pytest

from benchmarks import soak_bench
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
from cluster.client.workload import TraceEntry, TraceScale, Workload, WorkloadRequest
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


def outcome(
    sent: float, ended: float, migrations: int = 0, status: str = "OK", index: int = 0
) -> Outcome:
    rec = RequestRecord(index, sent, 16, 3, sent_s=sent, status=status)
    if status == "OK":
        rec.token_ids, rec.token_times = [5, 6, 7], [sent + 0.1, sent + 0.2, ended]
        rec.timing = PhaseTiming(0.0, 0.05, 0.0, 0.1, ended - sent - 0.1, ended - sent, "p", "d")
    return Outcome(rec, migrations, ended, *PLAN[index % 4])


PLAN = [("proxy", "greedy"), ("direct", "greedy"), ("proxy", "sampled"), ("direct", "sampled")]


class FakeStub:
    """`Generate` answering two tokens in one message, with a timing; the requests it got."""

    def __init__(self) -> None:
        self.requests = []

    def Generate(self, request, metadata, timeout):
        self.requests.append(request)

        async def messages():
            yield pb.GenerateResponse(
                token_ids=[5, 6], timing=pb.Timing(migrations=1, decode_replica="d1")
            )

        return messages()


def test_requests_alternate_paths_and_greedy_with_seeded_sampling(monkeypatch) -> None:
    made = {"proxy": FakeStub(), "direct": FakeStub()}
    order = iter(made.values())  # the stubs are made in the order of `targets`
    monkeypatch.setattr(soak_bench.pb_grpc, "GenerationStub", lambda channel: next(order))
    targets = {"proxy": "127.0.0.1:1", "direct": "127.0.0.1:2"}
    requests = {i: WorkloadRequest(0.0, (16, 17), 2) for i in (0, 1, 2, 3, 7)}

    outs = asyncio.run(soak_bench.send(targets, requests, 0.0, 5.0))

    assert [(o.record.index, o.path, o.kind) for o in outs] == [
        (0, "proxy", "greedy"), (1, "direct", "greedy"), (2, "proxy", "sampled"),
        (3, "direct", "sampled"), (7, "direct", "sampled"),
    ]  # fmt: skip
    assert all(o.record.ok and o.migrations == 1 and o.record.token_ids == [5, 6] for o in outs)
    greedy, sampled = made["proxy"].requests
    assert greedy.sampling.temperature == 0.0 and not greedy.sampling.HasField("seed")
    assert sampled.sampling.seed == 2 and sampled.sampling.ignore_eos
    assert sampled.sampling.temperature == pytest.approx(0.8)
    assert sampled.sampling.top_p == pytest.approx(0.95)
    direct = made["direct"].requests
    assert [r.sampling.HasField("seed") and r.sampling.seed for r in direct] == [False, 3, 7]


def test_requests_are_split_by_the_kills_they_were_in_flight_for() -> None:
    calm, hit, moved = outcome(0.0, 1.0), outcome(1.5, 3.0), outcome(1.0, 5.0, migrations=2)
    failed = outcome(4.5, 4.7, status="UNAVAILABLE")
    kills = [Kill(2.0, "Decode", "abc", 9.0), Kill(4.6, "Prefill", "def")]
    s = SoakSummary.of([calm, hit, moved, failed], kills)

    assert s.groups == {GROUPS[0]: [calm], GROUPS[1]: [hit, moved], GROUPS[2]: [moved]}
    assert s.failures == {"UNAVAILABLE": 1}
    assert (s.migrations, s.migrated, s.wrong_length) == (2, 1, 0)
    assert s.in_flight == [2, 2]  # the failed one counts where it was in flight


def test_the_oracle_checks_every_request_served_with_its_own_sampling(monkeypatch) -> None:
    served = [outcome(float(i), i + 0.5, index=i) for i in range(4)]
    s = SoakSummary.of([*served, outcome(5.0, 5.5, status="UNAVAILABLE", index=4)], [])
    work = Workload(tuple(WorkloadRequest(0.0, (16, i), 3) for i in range(5)), "w")
    seen = []

    class FakeOracle:
        def __init__(self, model_dir: str) -> None:
            assert model_dir == "ckpt"

        def check(self, prompt, tokens, params) -> str:
            seen.append((prompt, tuple(tokens), params.greedy, params.seed))
            return "wrong" if prompt[1] == 2 else "exact"

    monkeypatch.setattr(soak_bench, "StreamOracle", FakeOracle)
    checked = soak_bench.verify("ckpt", work, s)

    assert checked == {0: "exact", 1: "exact", 2: "wrong", 3: "exact"}  # not the failed one
    # request i: greedy for i // 2 even, else sampled with seed i (as `stream` sent it)
    assert [(g, seed) for *_, g, seed in seen] == [
        (True, None),
        (True, None),
        (False, 2),
        (False, 3),
    ]
    assert all(tokens == (5, 6, 7) for _, tokens, *_ in seen)


def test_the_report_prints_failures_migrations_the_cost_of_a_kill_and_leaks() -> None:
    outcomes = [outcome(0.0, 1.0), outcome(1.5, 3.0, index=1), outcome(1.0, 5.0, 1, index=2)]
    outcomes.append(outcome(4.5, 4.7, status="UNAVAILABLE", index=3))
    outcomes[3].record.error = "no replica"
    # request 1 asked one token: the router named its prefill replica as the decode one too
    rec = outcomes[1].record
    rec.timing = replace(rec.timing, prefill_replica="p2", decode_replica="p2")
    s = SoakSummary.of(outcomes, [Kill(2.0, "Decode", "abc", 9.0), Kill(4.6, "Prefill", "d")])
    replicas = [
        pb.ReplicaStats(pool="decode", replica_id="r1", kv_blocks_used=2),
        pb.ReplicaStats(pool="prefill", replica_id="r2", kv_blocks_leased=1),
    ]
    checked = {1: "exact", 2: "boundary", 0: "wrong"}
    run = SoakRun(Workload((), "a trace"), s, replicas, 1.5, checked, "grpc", 5.0)
    a = argparse.Namespace(num_blocks=64, preset="tiny")

    report = render(a, ["--minutes", "1"], run, 12.0)

    assert "4 sent, 3 served, failed: UNAVAILABLE 1." in report
    assert "Migrations: 1 over 1 requests" in report
    assert "every engine replica: 3**" in report
    assert "the 3 requests served against transformers: 1 exact, 1 wrong**, 1 with" in report
    head = cells(report, "path, sampling")
    assert head == ["sent", "served", "failed", "migrated", "in flight during a kill",
                    "exact", "at a boundary", "wrong"]  # fmt: skip
    assert cells(report, "proxy, greedy") == ["1", "1", "0", "0", "0", "0", "0", "1"]
    assert cells(report, "direct, greedy") == ["1", "1", "0", "0", "1", "1", "0", "0"]
    assert cells(report, "proxy, sampled") == ["1", "1", "0", "1", "1", "0", "1", "0"]
    assert cells(report, "direct, sampled") == ["1", "0", "1", "0", "1", "0", "0", "0"]
    assert cells(report, "all") == ["4", "3", "1", "1", "3", "1", "1", "1"]
    assert cells(report, "requests") == ["1", "2", "1"]
    assert "Latency cost of a kill" in report
    assert cells(report, "2.0") == ["Decode abc", "2", "9.0"]
    assert cells(report, "decode") == ["r1", "2", "0", "0", "0"]
    assert "request 3 (direct, sampled), 4.5-4.7 s: UNAVAILABLE 'no replica' after 0 of 3 " \
        "tokens; kills: Prefill at 4.6 s" in report  # fmt: skip
    # replicas named by their pool: the prefill replica is not counted as a decode one
    assert "1 requests name a prefill replica as their decode one" in report
    assert "requests per replica: prefill p 2, p2 1; decode ? 1, d 2" in report
