"""The ratio policy's state as `GetStats` carries it and `pdserve status` shows it: the split
followed now with its mix and predicted goodput, or why there is none, and the latest
changes."""

from __future__ import annotations

from datetime import UTC, datetime

from cluster.cli.status import Snapshot, render, status_json
from cluster.pb.pdserve.v1 import generation_pb2 as pb
from cluster.planner.split_decision import SplitDecision
from cluster.planner.split_planner import PlannerState
from router.grpc_api import ratio_policy_to_proto

PROMPT = SplitDecision(2, 1, 620, 2, 4.65, 0.07, 0.06, ((1, 0.02), (2, 0.07)))
DECODE = SplitDecision(1, 2, 50, 101, 4.05, 2.24, 1.0, ((1, 2.24), (2, 2.01)))


def snapshot(state: PlannerState | None) -> Snapshot:
    stats = pb.ClusterStats(kv_transport="nixl", ratio_policy=ratio_policy_to_proto(state))
    info = pb.ModelInfo(model_id="m", mode="disaggregated", block_size=16)
    return Snapshot(info, stats, datetime.now(UTC))


def test_the_split_followed_and_its_changes_are_shown():
    state = PlannerState(DECODE, "simulated", 1000.0, ((10.0, PROMPT), (20.0, DECODE)))
    message = ratio_policy_to_proto(state)
    assert message.current.decided_at == 20.0 and message.current.decode_replicas == 2
    assert [d.prefill_replicas for d in message.history] == [2, 1]
    lines = render(snapshot(state))
    head = next(line for line in lines if line.startswith("ratio policy:"))
    assert head.startswith("ratio policy: 1P:2D for prompts ~50 and outputs ~101 tokens")
    assert "predicted goodput 2.24 req/s (100% within the SLOs)" in head
    table = lines[lines.index(head) + 1 :]
    assert table[0].split() == ["decided", "split", "prompt", "output", "req/s", "goodput",
                                "attainment"]  # fmt: skip
    assert table[1].split()[1:] == ["2P:1D", "620", "2", "4.65", "0.07", "6%"]
    got = status_json(snapshot(state))["ratio_policy"]
    assert got["current"]["mean_output_tokens"] == 101 and len(got["history"]) == 2


def test_no_split_says_why_and_no_policy_shows_nothing():
    state = PlannerState(None, "3 requests in the last 6 s (fewer than 4)", 1000.0)
    lines = render(snapshot(state))
    assert "ratio policy: no split, 3 requests in the last 6 s (fewer than 4)" in lines
    assert not ratio_policy_to_proto(None)
    assert not any(line.startswith("ratio policy") for line in render(snapshot(None)))
    assert "ratio_policy" not in status_json(snapshot(None))
