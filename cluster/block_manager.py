"""Allocation of the paged KV pool's blocks.

Ownership: a block id belongs to whoever holds a reference to it. `allocate` returns blocks with
one reference each; `share` adds a reference; `free` drops one reference per id, and a block
whose count reaches zero goes back to the free list at once. A freed block's contents are
garbage: nobody may read it again without allocating it anew.
"""

from __future__ import annotations

from collections import deque

from cluster.errors import ResourceExhausted


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ResourceExhausted(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, block_ids: list[int]) -> None:
        for i in block_ids:
            if self._refs[i] <= 0:
                raise ValueError(f"block {i} is free and cannot be shared")
            self._refs[i] += 1

    def free(self, block_ids: list[int]) -> None:
        for i in block_ids:
            if self._refs[i] <= 0:
                raise ValueError(f"double free of block {i}")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]
