"""Prefix-affinity routing: the index, and the router's choices against Serve's interfaces.

The end-to-end proof (real Serve, two prefill replicas, the prefix cache hit every time) is in
tests/e2e/test_serving.py; here stand-ins for Serve's replicas (only the id and queue limit
the router reads) exercise each rule on its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from cluster.engine.prefix_hash import ROOT, block_hash
from cluster.request import Request
from cluster.sampling_params import SamplingParams
from router.prefix_affinity import PrefixAffinityRouter, PrefixIndex, prompt_block_hashes

DEPLOYMENT = DeploymentID(name="Prefill", app_name="pd")
LOOP = asyncio.new_event_loop()  # the handle's routing loop in Serve


@dataclass
class Replica:
    """What the router reads of Serve's RunningReplica."""

    replica_id: ReplicaID
    max_ongoing_requests: int = 64


def replicas(*names: str) -> list[Replica]:
    return [Replica(ReplicaID(n, DEPLOYMENT)) for n in names]


def make_router(max_imbalance: int = 2) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(
        DEPLOYMENT, DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True
    )
    router.initialize_state(block_size=4, max_imbalance=max_imbalance)
    return router


_calls = iter(range(1 << 30))


def call(prompt: list[int]) -> PendingRequest:
    request = Request(f"r{next(_calls)}", prompt, SamplingParams(max_tokens=1))
    meta = RequestMetadata(request_id=request.request_id, internal_request_id=request.request_id)
    return PendingRequest([request], {}, meta, future=LOOP.create_future())


def choose(router, pool, pending) -> list[list[str]]:
    """The ranks, each sorted: within a rank Serve takes the shortest queue."""
    ranks = LOOP.run_until_complete(router.choose_replicas(pool, pending))
    return [sorted(r.replica_id.unique_id for r in rank) for rank in ranks]


def send(router, pool, pending, name: str) -> None:
    """Serve routed `pending` to replica `name`."""
    (replica,) = [r for r in pool if r.replica_id.unique_id == name]
    router.on_request_routed(pending, replica.replica_id, None)


def test_prompt_hashes_are_the_engine_caches_chain_over_full_blocks():
    ids = list(range(10, 21))  # 11 tokens: 2 full blocks of 4
    first = block_hash(ROOT, ids[:4])
    assert prompt_block_hashes(ids, 4, 64) == [first, block_hash(first, ids[4:8])]
    assert prompt_block_hashes(ids, 4, 1) == [first]
    assert prompt_block_hashes(ids[:3], 4, 64) == []


def test_longest_match_needs_the_whole_chain_and_a_live_replica():
    index = PrefixIndex(capacity=100)
    a, b, c = (prompt_block_hashes(list(range(s, s + 12)), 4, 64) for s in (0, 0, 50))
    index.record(a[:1], "A")
    index.record(b, "B")
    assert index.longest_match(a, {"A", "B"}) == (["B"], 3)
    assert index.longest_match(a[:1], {"A", "B"}) == (["A", "B"], 1)
    assert index.longest_match(a, {"A"}) == (["A"], 1)  # B left the pool
    assert index.longest_match(c, {"A", "B"}) == ([], 0)
    index.record(c[1:], "A")  # a chain without its first block cannot be reused
    assert index.longest_match(c, {"A", "B"}) == ([], 0)


def test_the_index_forgets_least_recently_sent_blocks_first_deepest_before_shallow():
    index = PrefixIndex(capacity=4)
    old = prompt_block_hashes(list(range(12)), 4, 64)
    new = prompt_block_hashes(list(range(100, 112)), 4, 64)
    index.record(old, "A")
    index.record(new, "B")
    assert len(index) == 4
    # Of the old chain only its first block is left, so a match is still found, shorter.
    assert index.longest_match(old, {"A", "B"}) == (["A"], 1)
    assert index.longest_match(new, {"A", "B"}) == (["B"], 3)
    index.forget(["B"])
    assert index.longest_match(new, {"A", "B"}) == ([], 0) and len(index) == 1


def test_a_repeated_prefix_goes_back_to_its_replica_first():
    router, pool = make_router(), replicas("A", "B", "C")
    prefix = list(range(100, 112))
    first = call(prefix + [1, 2])
    send(router, pool, first, "B")  # (wherever Serve sent it)
    later = call(prefix + [7, 7, 7, 7, 9])
    assert choose(router, pool, later) == [["B"], ["A", "C"]]
    # Half the prompt's blocks shared: still B. A third of them: placed as a new prompt is,
    # the same as by a router that has seen nothing.
    assert choose(router, pool, call(prefix[:8] + [5] * 8)) == [["B"], ["A", "C"]]
    weak = prefix[:4] + [5] * 8
    assert choose(router, pool, call(weak)) == choose(make_router(), pool, call(weak))
    # A prompt shorter than a block has nothing to match or place by: two at random.
    assert len(choose(router, pool, call([1, 2, 3]))[0]) == 2


def test_a_new_prompt_goes_where_every_router_would_send_it():
    """Rendezvous hashing on the first 4 blocks: routers that share no history agree, prompts
    spread over the replicas, and a replica leaving moves only the prompts it had."""
    pool = replicas("A", "B", "C")
    ours, theirs = make_router(), make_router()
    prompts = [[1000 + 37 * i + j for j in range(20)] for i in range(40)]
    placed = {}
    for ids in prompts:
        ranks = choose(ours, pool, call(ids))
        assert len(ranks[0]) == 1 and ranks[0] == choose(theirs, pool, call(ids))[0]
        assert sorted(ranks[0] + ranks[1]) == ["A", "B", "C"]
        placed[tuple(ids)] = ranks[0][0]
    assert set(placed.values()) == {"A", "B", "C"}
    # Only the first 4 blocks (16 tokens here) count: a different tail changes nothing.
    assert choose(ours, pool, call(prompts[0][:16] + [7] * 9))[0] == [placed[tuple(prompts[0])]]
    survivors = replicas("A", "B")
    for ids, replica in placed.items():
        if replica != "C":
            assert choose(ours, survivors, call(list(ids)))[0] == [replica]


def test_a_new_prompt_goes_to_the_less_loaded_of_its_two_rendezvous_replicas():
    router, pool = make_router(max_imbalance=2), replicas("A", "B", "C")
    ids = list(range(3000, 3020))
    (first,), _ = choose(router, pool, call(ids))
    (second,), _ = choose(router, [r for r in pool if r.replica_id.unique_id != first], call(ids))
    busy = [r for r in pool if r.replica_id.unique_id == first][0]
    router.on_new_queue_len_info(busy.replica_id, 1)
    assert choose(router, pool, call(ids))[0] == [second]  # one more call: the other of the two
    other = [r for r in pool if r.replica_id.unique_id == second][0]
    for replica in (busy, other):  # both 3 over the third replica: two at random
        router.on_new_queue_len_info(replica.replica_id, 3)
    assert len(choose(router, pool, call(ids))[0]) == 2


def test_the_longest_match_wins_and_ties_go_to_all_holders():
    router, pool = make_router(), replicas("A", "B")
    system = list(range(200, 208))
    short, long_ = call(system), call(system + [3, 4, 5, 6])
    send(router, pool, short, "A")
    send(router, pool, long_, "B")
    assert choose(router, pool, call(system + [3, 4, 5, 6, 1])) == [["B"], ["A"]]
    assert choose(router, pool, call(system + [9, 9, 9, 9])) == [["A", "B"]]
    for pending in (short, long_):
        router.on_request_completed(None, pending.metadata.internal_request_id)


def test_a_loaded_holder_is_passed_over_until_its_load_falls_back():
    router, pool = make_router(max_imbalance=2), replicas("A", "B")
    prefix = list(range(300, 308))
    open_calls = [call(prefix + [i]) for i in range(3)]
    for pending in open_calls[:2]:
        send(router, pool, pending, "A")
    assert choose(router, pool, call(prefix)) == [["A"], ["B"]]  # 2 more than B: still A
    send(router, pool, open_calls[2], "A")
    assert choose(router, pool, call(prefix))[0] != ["A"]  # 3 more: A is passed over
    router.on_request_completed(None, open_calls[0].metadata.internal_request_id)
    router.on_request_completed(None, open_calls[0].metadata.internal_request_id)  # once only
    assert choose(router, pool, call(prefix)) == [["A"], ["B"]]


def test_what_serve_heard_of_a_replicas_queue_counts_as_load():
    """Other routers' calls reach this router as Serve's cached queue lengths."""
    router, pool = make_router(max_imbalance=2), replicas("A", "B")
    prefix = list(range(400, 408))
    send(router, pool, call(prefix), "A")
    router.on_new_queue_len_info(pool[0].replica_id, 5)
    assert choose(router, pool, call(prefix))[0] != ["A"]


def test_replicas_that_left_the_pool_are_forgotten():
    router, pool = make_router(), replicas("A", "B")
    prefix = list(range(500, 508))
    send(router, pool, call(prefix), "A")
    assert choose(router, pool, call(prefix)) == [["A"], ["B"]]
    survivors = replicas("B", "C")
    assert choose(router, survivors, call(prefix)) == choose(make_router(), survivors, call(prefix))
    # Back with A: what it was sent is forgotten, the choice is a fresh router's.
    assert choose(router, pool, call(prefix)) == choose(make_router(), pool, call(prefix))


def test_each_placed_prompt_is_counted_by_outcome():
    router, pool = make_router(), replicas("A", "B")
    prefix = list(range(1100, 1112))
    send(router, pool, call(prefix + [1]), "A")  # nothing known
    send(router, pool, call(prefix + [2]), "A")  # back where its prefix went
    send(router, pool, call(prefix + [3]), "B")  # A held it, B got it (A was busy)
    send(router, pool, call(prefix[:4] + [9] * 8), "A")  # a third of it matched: as new
    meta = RequestMetadata(request_id="s", internal_request_id="s", call_method="stats")
    send(router, pool, PendingRequest([], {}, meta, future=LOOP.create_future()), "A")
    assert router.outcomes == {"new_prefix": 2, "cached_prefix": 1, "spilled": 1}


def test_calls_without_a_request_are_routed_by_load_alone():
    router, pool = make_router(), replicas("A", "B", "C")
    meta = RequestMetadata(request_id="s", internal_request_id="s", call_method="stats")
    (rank,) = choose(router, pool, PendingRequest([], {}, meta, future=LOOP.create_future()))
    assert len(rank) == 2
    assert len(choose(router, pool, None)[0]) == 2
