"""Block allocation: references, sharing, freeing, and refusal when the pool is short."""

from __future__ import annotations

import pytest

from cluster.engine.block_manager import BlockManager
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


# -- prefix caching ----------------------------------------------------------------------------

H = [bytes([i]) * 16 for i in range(8)]  # stand-in block hashes


def two_cached_blocks() -> tuple[BlockManager, list[int]]:
    """A pool of 4 with blocks `a` computed for H[0] and H[1], both freed (cached, free)."""
    bm = BlockManager(4, block_size=4, enable_caching=True)
    a = bm.allocate(2)
    bm.register(a[0], H[0])
    bm.register(a[1], H[1])
    bm.free(a)
    return bm, a


def test_registered_blocks_outlive_their_last_reference_until_reclaimed():
    bm, a = two_cached_blocks()
    assert (bm.num_free, bm.num_used, bm.num_cached) == (4, 0, 2)
    assert bm.lookup([H[0], H[1], H[2]]) == a  # the longest cached prefix, re-referenced
    assert [bm.ref_count(i) for i in a] == [1, 1] and bm.num_used == 2
    bm.free(a)
    # Never-cached blocks go first, then cached ones, the tail block before the prefix.
    fresh = bm.allocate(2)
    assert not set(fresh) & set(a) and bm.num_cached == 2
    assert bm.allocate(1) == [a[1]] and bm.num_cached == 1
    assert bm.lookup([H[0], H[1]]) == [a[0]]
    assert bm.lookup([H[1]]) == []  # a[1] was reclaimed and forgot its hash


def test_cached_prefix_counts_without_taking_references():
    bm, _ = two_cached_blocks()
    assert bm.cached_prefix([H[0], H[1], H[2]]) == 2
    assert bm.cached_prefix([H[1]]) == 1 and bm.cached_prefix([H[2], H[0]]) == 0
    assert (bm.num_free, bm.num_used, bm.num_cached) == (4, 0, 2)  # nothing referenced
    bm.allocate(3)  # two fresh blocks, then the cached tail block is reclaimed
    assert bm.cached_prefix([H[0], H[1]]) == 1
    assert BlockManager(4, block_size=4).cached_prefix([H[0]]) == 0  # caching off


def test_lookup_shares_a_block_that_is_still_held():
    bm = BlockManager(4, block_size=4, enable_caching=True)
    (a,) = bm.allocate(1)
    bm.register(a, H[0])
    assert bm.lookup([H[0]]) == [a] and bm.ref_count(a) == 2
    bm.free([a])
    assert bm.num_used == 1
    bm.free([a])
    assert bm.num_used == 0 and bm.num_cached == 1


def test_a_hash_keeps_its_first_block():
    bm = BlockManager(4, block_size=4, enable_caching=True)
    a, b = bm.allocate(2)
    bm.register(a, H[0])
    bm.register(b, H[0])  # the same content computed twice: b stays private
    bm.register(a, H[1])  # a block holds one content
    bm.free([a, b])
    assert bm.num_cached == 1 and bm.lookup([H[0]]) == [a] and bm.lookup([H[1]]) == []


def test_registering_a_free_block_raises():
    bm = BlockManager(2, block_size=4, enable_caching=True)
    with pytest.raises(ValueError, match="free"):
        bm.register(0, H[0])


def test_without_caching_nothing_is_kept():
    bm = BlockManager(2, block_size=4)
    a = bm.allocate(1)
    bm.register(a[0], H[0])
    bm.free(a)
    assert bm.num_cached == 0 and bm.lookup([H[0]]) == []
