"""`BlockManager`: the only owner of the paged KV pool's blocks, with prefix caching.

Ownership: a block id belongs to whoever holds a reference to it; a sequence holds one
reference to each block of its `block_table`, and only this class writes a block table. The
engine and the scheduler ask it: `reserve` grows a sequence's table with new blocks (one
reference each), `reuse_cached_prefix` starts an empty table with cached blocks (a new
reference each), `free` drops the sequence's reference to every block of its table and empties
it. A block whose count reaches zero is free: nobody may read it again without getting it anew.

Prefix caching (`enable_caching`): a full block whose KV has been computed may be `register`ed
under its content hash (`cluster.engine.prefix_hash`). When its last reference goes, it keeps its
contents and hash as a free but *cached* block; `reuse_cached_prefix` hands it out again to a
sequence whose prefix has the same hashes. New blocks are never-cached ones first, then the
cached ones least recently freed first, which forget their hash. Free counts include cached
blocks: they are reclaimable at any time.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from cluster.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding registered KV, referenced or not."""
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    # -- a sequence's blocks ---------------------------------------------------------------

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq.block_table` with new blocks until it holds `num_tokens` tokens. False,
        changing nothing, if the pool is short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        seq.block_table.extend(self._allocate(need))
        return True

    def reuse_cached_prefix(self, seq: Sequence, hashes: list[bytes]) -> int:
        """Give `seq`, whose table is empty, the cached blocks of the longest prefix of
        `hashes`, a new reference each; returns how many."""
        if seq.block_table:
            raise ValueError(f"{seq.request_id} already has blocks; only an empty table reuses")
        seq.block_table = self._lookup(hashes)
        return len(seq.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s reference to each block of its table and empty the table."""
        self._free_ids(seq.block_table)
        seq.block_table = []

    # -- the prefix cache ------------------------------------------------------------------

    def cached_prefix(self, hashes: list[bytes]) -> int:
        """How many blocks of the longest prefix of `hashes` the cache holds now; takes no
        reference, so they may be evicted before anyone asks for them."""
        n = 0
        for h in hashes if self.enable_caching else ():
            if h not in self._block_of:
                break
            n += 1
        return n

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record that held block `block_id` holds the computed KV of `block_hash`. A hash
        already cached elsewhere keeps its block (this one stays private)."""
        if self._refs[block_id] <= 0:
            raise ValueError(f"block {block_id} is free and cannot be registered")
        if not self.enable_caching or block_hash in self._block_of or block_id in self._hash_of:
            return
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash

    # -- block ids -------------------------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        ids = []
        for _ in range(n):
            if self._free:
                i = self._free.popleft()
            else:
                i, _ = self._cached_free.popitem(last=False)
                del self._block_of[self._hash_of.pop(i)]
            self._refs[i] = 1
            ids.append(i)
        return ids

    def _lookup(self, hashes: list[bytes]) -> list[int]:
        ids: list[int] = []
        for h in hashes if self.enable_caching else ():
            i = self._block_of.get(h)
            if i is None:
                break
            if self._refs[i] == 0:
                del self._cached_free[i]
            self._refs[i] += 1
            ids.append(i)
        return ids

    def _free_ids(self, block_ids: list[int]) -> None:
        # Last block first: a sequence's tail is then evicted before the prefix it extends.
        for i in reversed(block_ids):
            if self._refs[i] <= 0:
                raise ValueError(f"double free of block {i}")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                if i in self._hash_of:
                    self._cached_free[i] = None
                else:
                    self._free.append(i)
