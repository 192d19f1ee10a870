"""Prefix-affinity routing for the pools that prefill (prefill, colocated).

Each replica keeps the KV of prompts it computed in its own prefix cache, so a prompt only
finds its prefix there if it goes back to a replica that computed it. Serve's default policy
(power of two choices, on queue length alone) sends a repeated system prompt or the next turn
of a conversation to a random replica: with N replicas every prefix is computed up to N times,
and each replica's cache has to hold every prefix, so the pool's cache capacity does not grow
with N.

`PrefixAffinityRouter` is a Serve request router. Serve runs one in every process that holds a
handle to the pool (each router replica), on the handle's routing loop; it sees each call's
arguments before a replica is chosen. For a call whose argument is a `Request` it hashes the
prompt's full blocks (the same chained hashes as the engine's prefix cache), looks them up in a
`PrefixIndex` of the prefixes it sent where, and ranks first the replicas holding the longest
match if it covers at least half of those blocks. A prompt without such a match goes to the
less loaded of the two replicas that rendezvous hashing ranks first for its first blocks, the
first on a tie: the same choice in every router replica while the load is even, so a
conversation's next turn finds its history whichever router it reaches. A replica with more
than `max_imbalance` calls in flight beyond the least loaded one is passed over: overloaded
holders leave the prompt to its rendezvous pair, an overloaded pair (like a call without a
prompt) to Serve's default, the less loaded of two random replicas. If the replica ranked first
turns the call away (its queue is full), two random others are tried.
"""

from __future__ import annotations

import hashlib
import heapq
import random
import threading
from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from cluster.engine.prefix_hash import extend_block_hashes
from cluster.request import Request
from cluster.serving.metrics import pool_metric

# A prompt's first 64 full blocks (1024 tokens with 16-token blocks) decide its replica: a
# longer shared prefix would not change the choice, and hashing stays cheap.
MAX_HASHED_BLOCKS = 64
# A match steers a call only if it covers at least this share of the prompt's hashed blocks:
# prompts that share just a chat template's first block would otherwise all pile onto one
# replica to save a few tokens each.
MIN_MATCH_SHARE = 0.5
# A prompt no replica was sent enough of goes to one of the two replicas that rank first for
# the hash of its first 4 blocks (64 tokens; rendezvous hashing), the same two in every router
# replica, so the next turn finds it there whichever router it reaches.
KEY_BLOCKS = 4


def prompt_block_hashes(token_ids: list[int], block_size: int, limit: int) -> list[bytes]:
    """Chained hashes of the first `limit` full blocks of a prompt (as the engine's cache)."""
    return extend_block_hashes([], token_ids, min(len(token_ids) // block_size, limit), block_size)


class PrefixIndex:
    """Which replicas were last sent which prompt blocks: at most `capacity` block hashes,
    least recently sent forgotten first. Not thread-safe; the router holds a lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._holders: OrderedDict[bytes, dict[str, None]] = OrderedDict()  # in send order

    def __len__(self) -> int:
        return len(self._holders)

    def longest_match(
        self, hashes: list[bytes], live: Collection[str] | None = None
    ) -> tuple[list[str], int]:
        """The replicas (of `live`, if given) that were sent the longest prefix of `hashes`, and
        its length in blocks. A replica counts at depth i only if it also holds depths 0..i-1
        (a prefix cache reuses a chain of blocks from the start)."""
        best: list[str] = []
        depth = 0
        for h in hashes:
            holders = self._holders.get(h) or ()
            here = [r for r in holders if (live is None or r in live) and (not depth or r in best)]
            if not here:
                break
            best, depth = here, depth + 1
        return best, depth

    def record(self, hashes: list[bytes], replica: str) -> None:
        """`replica` was sent a prompt starting with `hashes`. Recorded deepest first, so the
        shallow blocks, which every longer match needs, are the last to be forgotten."""
        for h in reversed(hashes):
            holders = self._holders.get(h)
            if holders is None:
                holders = self._holders[h] = {}
            else:
                self._holders.move_to_end(h)
            holders[replica] = None
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, replicas: Iterable[str]) -> None:
        """Drop replicas that left the pool."""
        gone = set(replicas)
        for h in list(self._holders):
            holders = self._holders[h]
            for r in gone & holders.keys():
                del holders[r]
            if not holders:
                del self._holders[h]


class PrefixAffinityRouter(RequestRouter):
    """Serve request router: prefix affinity, bounded by load (see the module docstring)."""

    def initialize_state(
        self, block_size: int = 16, max_imbalance: int = 2, index_blocks: int = 1 << 17
    ) -> None:
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.index = PrefixIndex(index_blocks)
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}  # replica id -> calls this router has open there
        self._routed: dict[str, str] = {}  # internal request id -> replica id
        self._known: set[str] = set()
        self.outcomes: Counter[str] = Counter()  # as exported in `pdserve_prefix_routing_total`
        self._outcome_metric = pool_metric(
            "pdserve_prefix_routing_total", self._deployment_id.name.lower()
        )

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        hashes = self._prompt_hashes(pending_request)
        with self._lock:
            self._forget_departed(candidate_replicas)
            load = {r.replica_id.unique_id: self._load(r) for r in candidate_replicas}
            holders, depth = self.index.longest_match(hashes, load)
        if depth < MIN_MATCH_SHARE * len(hashes):
            holders = []
        lightest = min(load.values())

        def light(r: RunningReplica) -> bool:
            return load[r.replica_id.unique_id] - lightest <= self.max_imbalance

        preferred = [
            r for r in candidate_replicas if r.replica_id.unique_id in holders and light(r)
        ]
        if not preferred and hashes:
            # Nothing cached to go back to yet: the less loaded of the prompt's two rendezvous
            # replicas (the first on a tie), so that under load it is placed by load.
            key = hashes[min(len(hashes), KEY_BLOCKS) - 1]
            pair = heapq.nlargest(2, candidate_replicas, key=lambda r: _rendezvous(key, r))
            first = min(pair, key=lambda r: load[r.replica_id.unique_id])
            preferred = [first] if light(first) else []
        if preferred:
            rest = [r for r in candidate_replicas if r not in preferred]
            return [preferred, _two_choices(rest)] if rest else [preferred]
        return [_two_choices(candidate_replicas)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        rid = pending_request.metadata.internal_request_id
        replica = replica_id.unique_id
        hashes = self._prompt_hashes(pending_request)
        with self._lock:
            if hashes:
                outcome = self._outcome(hashes, replica)
                self.outcomes[outcome] += 1
                self._outcome_metric.inc(tags={"outcome": outcome})
                self.index.record(hashes, replica)
            if rid not in self._routed:
                self._routed[rid] = replica
                self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._lock:
            replica = self._routed.pop(internal_request_id, None)
            if replica is not None and self._in_flight.get(replica, 0) > 0:
                self._in_flight[replica] -= 1

    def _prompt_hashes(self, pending_request: PendingRequest | None) -> list[bytes]:
        """The hashes of the call's prompt; [] for a call without a `Request`. Computed again
        where needed rather than kept per call: a call cancelled while it waits for a replica
        gets no callback that could drop what was kept."""
        args = pending_request.args if pending_request is not None else ()
        request = next((a for a in args if isinstance(a, Request)), None)
        if request is None:
            return []
        return prompt_block_hashes(request.prompt_token_ids, self.block_size, MAX_HASHED_BLOCKS)

    def _outcome(self, hashes: list[bytes], replica: str) -> str:
        """Before recording: did the call go where the index says its prefix is?"""
        holders, depth = self.index.longest_match(hashes)  # departed replicas are forgotten
        if not depth or depth < MIN_MATCH_SHARE * len(hashes):
            return "new_prefix"
        return "cached_prefix" if replica in holders else "spilled"

    def _load(self, replica: RunningReplica) -> int:
        """Calls open at the replica: this router's own count, or what Serve last heard from the
        replica (which includes other routers' calls), whichever is larger."""
        mine = self._in_flight.get(replica.replica_id.unique_id, 0)
        heard = self._replica_queue_len_cache.get(replica.replica_id)
        return max(mine, heard or 0)

    def _forget_departed(self, candidates: list[RunningReplica]) -> None:
        live = {r.replica_id.unique_id for r in candidates}
        if live == self._known:
            return
        departed = self._known - live
        if departed:
            self.index.forget(departed)
            for r in departed:
                self._in_flight.pop(r, None)
        self._known = live


def _rendezvous(key: bytes, replica: RunningReplica) -> bytes:
    """Replica `replica`'s score for `key`: the highest score wins, the same in every process,
    and a replica joining or leaving moves only the keys it wins or won."""
    return hashlib.blake2b(key + replica.replica_id.unique_id.encode(), digest_size=8).digest()


def _two_choices(candidates: list[RunningReplica]) -> list[RunningReplica]:
    """Serve's default: two replicas at random; Serve takes the one with the shorter queue."""
    return random.sample(candidates, min(2, len(candidates)))
