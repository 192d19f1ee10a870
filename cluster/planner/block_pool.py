"""`BlockPool`: one simulated replica's paged KV pool, counted in blocks, with the engine's
prefix cache: a full prompt block, once computed, is known by its key (`SimRequest.block_keys`);
a later sequence reuses it while it is in use (shared, counted once) or cached (free but
holding its KV, reclaimed least recently freed first when the pool needs room).

Invariant: `used + len(cached) <= total`. A sequence holds `anon` blocks of its own and the
keyed blocks it listed; `release` gives both back.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, total: int, caching: bool = True) -> None:
        self.total = total
        self.caching = caching
        self.used = 0
        self.live: dict[int, int] = {}  # keyed blocks in use -> sequences holding each
        self.cached: OrderedDict[int, None] = OrderedDict()  # free keyed blocks, LRU first

    def available(self) -> int:
        """Blocks an allocation may take: free ones and cached ones it would evict."""
        return self.total - self.used

    def allocate(self, n: int) -> bool:
        if n > self.total - self.used:
            return False
        while self.total - self.used - len(self.cached) < n:
            self.cached.popitem(last=False)
        self.used += n
        return True

    def match(self, keys: tuple[int, ...]) -> int:
        """How many leading `keys` the pool holds (in use or cached)."""
        if not self.caching:
            return 0
        n = 0
        for k in keys:
            if k not in self.live and k not in self.cached:
                break
            n += 1
        return n

    def take(self, keys: tuple[int, ...]) -> None:
        """A sequence reuses these blocks (all held: `match` said so)."""
        for k in keys:
            if k in self.cached:
                del self.cached[k]
                self.used += 1
                self.live[k] = 1
            else:
                self.live[k] += 1

    def register(self, keys: tuple[int, ...], limit: int) -> list[int]:
        """A sequence's own blocks, now full, are known by `keys`: those of them (at most
        `limit`) that no other block holds become keyed; the rest stay the sequence's own, as
        all do when caching is off. Returns the keys that took."""
        if not self.caching:
            return []
        live, cached = self.live, self.cached
        new = [k for k in keys if k not in live and k not in cached][:limit]
        for k in new:
            live[k] = 1
        return new

    def release(self, anon: int, keys: list[int]) -> None:
        self.used -= anon
        for k in keys:
            left = self.live[k] - 1
            if left:
                self.live[k] = left
            else:
                del self.live[k]
                self.used -= 1
                self.cached[k] = None
