"""A colocated app whose replica spans 2 tensor-parallel ranks, end to end on a real local Ray:
its deployment reserves a STRICT_PACK placement group of one bundle per rank, the replica's
engine is rank 0 of a `TPReplica` whose other rank is a Ray actor of its own in the second
bundle (`BundleRanks`), and concurrent greedy requests through the router equal transformers'
`generate(do_sample=False)` on the same checkpoint. Afterwards no KV block is used, `GetStats`
lists the replica's TP size and both ranks (rank 0 the replica's process, rank 1 a `_TPRank`
Ray worker, not its child, both alive, on the replica's node), and once the app is deleted no
rank's process is left."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.pb.pdserve.v1 import generation_pb2 as pb
from tests.ray_fixtures import app_metadata, deploy, small_app_config, stub, wait_for_idle

APP = "tp"
TP = 2
NEW_TOKENS = 8


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[1])


def _replicas() -> set[int]:
    """The pids of the app's replica actors."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return {p for p in pids if f"ServeReplica:{APP}:Colocated" in _cmdline(p)}


def follower_pids(replicas: list[pb.ReplicaStats]) -> list[int]:
    """The pids of ranks 1.. of `replicas`, as GetStats lists them."""
    return sorted(r.pid for replica in replicas for r in replica.ranks if r.rank > 0)


def _assert_ranks_placed(replica: pb.ReplicaStats) -> None:
    """GetStats' ranks: rank 0 the replica's actor, rank 1.. `_TPRank` actors of their own
    (Ray workers, not the replica's children), alive, all on the replica's node (the one
    local Ray node)."""
    import ray

    (node,) = [n for n in ray.nodes() if n["Alive"]]
    assert [r.rank for r in replica.ranks] == list(range(TP))
    assert {(r.node_id, r.node_ip) for r in replica.ranks} == {
        (node["NodeID"], node["NodeManagerAddress"])
    }
    leader, *rest = (r.pid for r in replica.ranks)
    assert leader in _replicas() and _alive(leader)
    for pid in rest:
        assert "ray::_TPRank" in _cmdline(pid) and _ppid(pid) != leader, _cmdline(pid)
        assert _alive(pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_colocated_tp2_serves_transformers_greedy_tokens(ray_serve, tokenizer_model_dir, hf):
    from ray import serve

    base = small_app_config(str(tokenizer_model_dir))
    pool = replace(base.decode, tensor_parallel_size=TP)
    followers: list[int] = []
    deploy(replace(base, mode="colocated", decode=pool), APP, f"/{APP}")
    try:
        followers = follower_pids(wait_for_idle(ray_serve, APP, {"colocated"}))
        assert len(followers) == TP - 1, followers
        s = stub(ray_serve)
        cases = [tuple((13 * i + 5 * j) % 4000 + 50 for j in range(4 + 7 * i)) for i in range(6)]

        def run(ids) -> list[pb.GenerateResponse]:
            sampling = pb.SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
            request = pb.GenerateRequest(prompt_token_ids=list(ids), sampling=sampling)
            return list(s.Generate(request, metadata=app_metadata(APP)))

        with ThreadPoolExecutor(len(cases)) as threads:
            results = list(threads.map(run, cases))
        for ids, msgs in zip(cases, results, strict=True):
            got = [t for m in msgs for t in m.token_ids]
            hf.assert_greedy(tokenizer_model_dir, ids, got, NEW_TOKENS)
            assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
        (replica,) = wait_for_idle(ray_serve, APP, {"colocated"})
        assert replica.kv_blocks_used == 0 and replica.running == 0
        assert replica.tensor_parallel_size == TP
        _assert_ranks_placed(replica)
        assert follower_pids([replica]) == followers
    finally:
        serve.delete(APP)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in followers if _alive(p)], "a TP rank outlived its replica"
