"""Block allocation: references, sharing, freeing, and refusal when the pool is short."""

from __future__ import annotations

import pytest

from cluster.block_manager import BlockManager
from cluster.errors import ResourceExhausted


def test_allocate_and_free_return_every_block():
    bm = BlockManager(8, block_size=4)
    a = bm.allocate(3)
    b = bm.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert (bm.num_free, bm.num_used) == (0, 8)
    assert all(bm.ref_count(i) == 1 for i in a + b)
    bm.free(a)
    assert (bm.num_free, bm.num_used) == (3, 5)
    bm.free(b)
    assert (bm.num_free, bm.num_used) == (8, 0)
    assert all(bm.ref_count(i) == 0 for i in range(8))


def test_freed_blocks_are_reused():
    bm = BlockManager(4, block_size=4)
    a = bm.allocate(4)
    bm.free(a[1:3])
    assert sorted(bm.allocate(2)) == sorted(a[1:3])


def test_shared_block_is_free_only_after_last_reference():
    bm = BlockManager(4, block_size=4)
    a = bm.allocate(2)
    bm.share(a)
    assert [bm.ref_count(i) for i in a] == [2, 2]
    bm.free(a)
    assert bm.num_free == 2 and [bm.ref_count(i) for i in a] == [1, 1]
    bm.free(a[:1])
    assert bm.num_free == 3
    bm.free(a[1:])
    assert bm.num_free == 4


def test_double_free_raises():
    bm = BlockManager(4, block_size=4)
    a = bm.allocate(1)
    bm.free(a)
    with pytest.raises(ValueError, match="double free"):
        bm.free(a)
    assert bm.num_free == 4


def test_sharing_a_free_block_raises():
    bm = BlockManager(4, block_size=4)
    with pytest.raises(ValueError):
        bm.share([0])


def test_exhaustion_raises_and_changes_nothing():
    bm = BlockManager(4, block_size=4)
    bm.allocate(3)
    assert bm.can_allocate(1) and not bm.can_allocate(2)
    with pytest.raises(ResourceExhausted):
        bm.allocate(2)
    assert bm.num_free == 1
    assert len(bm.allocate(1)) == 1


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4), (17, 5)])
def test_blocks_for(tokens, blocks):
    assert BlockManager(8, block_size=4).blocks_for(tokens) == blocks
