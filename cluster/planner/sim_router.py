"""`SimRouter`: how the router spreads one pool's calls over its replicas, as pdserve does it.
The load of a replica is the calls it has in flight (a prefill call ends with the first token,
a decode or colocated call with the last).

- Serve's default (the decode pool, and any pool without prefix affinity): the less loaded of
  two replicas drawn at random.
- Prefix affinity (`router/prefix_affinity.py`, the pools that prefill): the replicas that were
  last sent the longest start of the prompt, if it covers at least half of its first 64
  blocks; else the less loaded of the two replicas rendezvous hashing ranks first for its
  first 4 blocks; either only while within `max_imbalance` calls of the least loaded replica,
  else the default.

Random draws come from the simulator's seeded generator, so a run is reproducible.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from cluster.planner.engine_sim import EngineSim

MAX_HASHED_BLOCKS = 64
MIN_MATCH_SHARE = 0.5
KEY_BLOCKS = 4
INDEX_BLOCKS = 1 << 17


class SimRouter:
    def __init__(self, rng: random.Random, affinity: bool = False, max_imbalance: int = 2) -> None:
        self.rng = rng
        self.affinity = affinity
        self.max_imbalance = max_imbalance
        self.replicas: list[EngineSim] = []
        self.load: dict[str, int] = {}
        self.ids: dict[str, int] = {}  # replica -> an integer of its own, for rendezvous hashing
        self.index: OrderedDict[int, dict[str, None]] = OrderedDict()  # block key -> holders

    def add(self, replica: EngineSim) -> None:
        self.replicas.append(replica)
        self.load.setdefault(replica.name, 0)
        self.ids.setdefault(replica.name, len(self.ids))

    def remove(self, replica: EngineSim) -> None:
        """No new calls go to `replica` (it drains what it has)."""
        self.replicas.remove(replica)

    def done(self, replica: EngineSim) -> None:
        self.load[replica.name] -= 1

    def choose(self, keys: tuple[int, ...] = ()) -> EngineSim:
        keys = keys[:MAX_HASHED_BLOCKS] if self.affinity else ()
        lightest = min(self.load[r.name] for r in self.replicas)

        def light(r: EngineSim) -> bool:
            return self.load[r.name] - lightest <= self.max_imbalance

        chosen = None
        if keys:
            holders, depth = self._longest_match(keys)
            if depth >= MIN_MATCH_SHARE * len(keys):
                fit = [r for r in self.replicas if r.name in holders and light(r)]
                chosen = min(fit, key=lambda r: self.load[r.name]) if fit else None
            if chosen is None:
                key = keys[min(len(keys), KEY_BLOCKS) - 1]
                ranked = sorted(self.replicas, key=lambda r: -hash((key, self.ids[r.name])))
                first = min(ranked[:2], key=lambda r: self.load[r.name])
                chosen = first if light(first) else None
        if chosen is None:
            chosen = self._two_choices()
        if keys:
            self._record(keys, chosen)
        self.load[chosen.name] += 1
        return chosen

    def _two_choices(self) -> EngineSim:
        if len(self.replicas) == 1:
            return self.replicas[0]
        a, b = self.rng.sample(self.replicas, 2)
        return a if self.load[a.name] <= self.load[b.name] else b

    def _longest_match(self, keys: tuple[int, ...]) -> tuple[set[str], int]:
        live = {r.name for r in self.replicas}
        best: set[str] = set()
        depth = 0
        for k in keys:
            holders = self.index.get(k) or {}
            here = {r for r in holders if r in live and (not depth or r in best)}
            if not here:
                break
            best, depth = here, depth + 1
        return best, depth

    def _record(self, keys: tuple[int, ...], replica: EngineSim) -> None:
        for k in reversed(keys):
            holders = self.index.get(k)
            if holders is None:
                holders = self.index[k] = {}
            else:
                self.index.move_to_end(k)
            holders[replica.name] = None
        while len(self.index) > INDEX_BLOCKS:
            self.index.popitem(last=False)
