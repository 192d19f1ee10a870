"""Block allocation: references, sharing, freeing, and refusal when the pool is short."""

from __future__ import annotations

import pytest

from cluster.engine.block_manager import BlockManager
from cluster.engine.sequence import Sequence
from cluster.request import Request
from tests.conftest import greedy


def seq(rid: str = "s") -> Sequence:
    return Sequence(Request(rid, (1, 2, 3), greedy(4)), 0, frozenset())


def holding(bm: BlockManager, num_tokens: int, rid: str = "s") -> Sequence:
    """A sequence whose table holds `num_tokens` tokens' worth of new blocks."""
    s = seq(rid)
    assert bm.reserve(s, num_tokens)
    return s


def test_reserve_and_free_return_every_block():
    bm = BlockManager(8, block_size=4)
    a, b = holding(bm, 12, "a"), holding(bm, 17, "b")  # 3 blocks, then 5
    ids = a.block_table + b.block_table
    assert len(set(ids)) == 8
    assert (bm.num_free, bm.num_used) == (0, 8)
    assert all(bm.ref_count(i) == 1 for i in ids)
    bm.free(a)
    assert a.block_table == [] and (bm.num_free, bm.num_used) == (3, 5)
    bm.free(b)
    assert (bm.num_free, bm.num_used) == (8, 0)
    assert all(bm.ref_count(i) == 0 for i in range(8))


def test_reserve_grows_the_table_only_by_what_it_lacks():
    bm = BlockManager(8, block_size=4)
    s = holding(bm, 5)
    first = list(s.block_table)
    assert len(first) == 2 and bm.reserve(s, 8) and s.block_table == first
    assert bm.reserve(s, 9) and s.block_table[:2] == first and len(s.block_table) == 3
    bm.free(s)


def test_freed_blocks_are_reused():
    bm = BlockManager(4, block_size=4)
    holding(bm, 4, "a")
    b = holding(bm, 8, "b")
    holding(bm, 4, "c")
    freed = b.block_table
    bm.free(b)
    assert sorted(holding(bm, 8, "d").block_table) == sorted(freed)


def test_shared_block_is_free_only_after_last_reference():
    bm = BlockManager(4, block_size=4, enable_caching=True)
    a = holding(bm, 8, "a")
    bm.register(a.block_table[0], H[0])
    bm.register(a.block_table[1], H[1])
    b = seq("b")
    assert bm.reuse_cached_prefix(b, [H[0], H[1]]) == 2 and b.block_table == a.block_table
    assert [bm.ref_count(i) for i in a.block_table] == [2, 2]
    bm.free(a)
    assert bm.num_free == 2 and [bm.ref_count(i) for i in b.block_table] == [1, 1]
    bm.free(b)
    assert bm.num_free == 4


def test_double_free_raises():
    bm = BlockManager(4, block_size=4)
    a = holding(bm, 1)
    twin = seq("twin")
    twin.block_table = list(a.block_table)  # a table this class never handed out
    bm.free(a)
    with pytest.raises(ValueError, match="double free"):
        bm.free(twin)
    assert bm.num_free == 4


def test_exhaustion_refuses_and_changes_nothing():
    bm = BlockManager(4, block_size=4)
    holding(bm, 12)
    s = holding(bm, 2, "s")
    before = list(s.block_table)
    assert not bm.reserve(s, 9)  # needs two more blocks, one is free
    assert s.block_table == before and bm.num_free == 0
    assert not bm.reserve(seq("t"), 1)
    bm.free(s)
    assert bm.reserve(s, 4) and bm.num_free == 0


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4), (17, 5)])
def test_blocks_for(tokens, blocks):
    assert BlockManager(8, block_size=4).blocks_for(tokens) == blocks


# -- prefix caching ----------------------------------------------------------------------------

H = [bytes([i]) * 16 for i in range(8)]  # stand-in block hashes


def two_cached_blocks() -> tuple[BlockManager, list[int]]:
    """A pool of 4 with blocks `a` computed for H[0] and H[1], both freed (cached, free)."""
    bm = BlockManager(4, block_size=4, enable_caching=True)
    s = holding(bm, 8)
    a = list(s.block_table)
    bm.register(a[0], H[0])
    bm.register(a[1], H[1])
    bm.free(s)
    return bm, a


def reused(bm: BlockManager, hashes: list[bytes], rid: str = "r") -> Sequence:
    s = seq(rid)
    bm.reuse_cached_prefix(s, hashes)
    return s


def test_registered_blocks_outlive_their_last_reference_until_reclaimed():
    bm, a = two_cached_blocks()
    assert (bm.num_free, bm.num_used, bm.num_cached) == (4, 0, 2)
    s = reused(bm, [H[0], H[1], H[2]])
    assert s.block_table == a  # the longest cached prefix, re-referenced
    assert [bm.ref_count(i) for i in a] == [1, 1] and bm.num_used == 2
    bm.free(s)
    # Never-cached blocks go first, then cached ones, the tail block before the prefix.
    fresh = holding(bm, 8, "fresh").block_table
    assert not set(fresh) & set(a) and bm.num_cached == 2
    assert holding(bm, 1, "tail").block_table == [a[1]] and bm.num_cached == 1
    assert reused(bm, [H[0], H[1]]).block_table == [a[0]]
    assert reused(bm, [H[1]]).block_table == []  # a[1] was reclaimed and forgot its hash


def test_cached_prefix_counts_without_taking_references():
    bm, _ = two_cached_blocks()
    assert bm.cached_prefix([H[0], H[1], H[2]]) == 2
    assert bm.cached_prefix([H[1]]) == 1 and bm.cached_prefix([H[2], H[0]]) == 0
    assert (bm.num_free, bm.num_used, bm.num_cached) == (4, 0, 2)  # nothing referenced
    holding(bm, 12)  # two fresh blocks, then the cached tail block is reclaimed
    assert bm.cached_prefix([H[0], H[1]]) == 1
    assert BlockManager(4, block_size=4).cached_prefix([H[0]]) == 0  # caching off


def test_lookup_shares_a_block_that_is_still_held():
    bm = BlockManager(4, block_size=4, enable_caching=True)
    s = holding(bm, 4)
    (a,) = s.block_table
    bm.register(a, H[0])
    t = reused(bm, [H[0]])
    assert t.block_table == [a] and bm.ref_count(a) == 2
    bm.free(s)
    assert bm.num_used == 1
    bm.free(t)
    assert bm.num_used == 0 and bm.num_cached == 1


def test_only_an_empty_table_starts_from_the_cache():
    bm, _ = two_cached_blocks()
    s = holding(bm, 4)
    with pytest.raises(ValueError, match="empty"):
        bm.reuse_cached_prefix(s, [H[0]])
    bm.free(s)
    assert bm.num_used == 0


def test_a_hash_keeps_its_first_block():
    bm = BlockManager(4, block_size=4, enable_caching=True)
    s = holding(bm, 8)
    a, b = s.block_table
    bm.register(a, H[0])
    bm.register(b, H[0])  # the same content computed twice: b stays private
    bm.register(a, H[1])  # a block holds one content
    bm.free(s)
    assert bm.num_cached == 1
    assert reused(bm, [H[0]]).block_table == [a] and reused(bm, [H[1]]).block_table == []


def test_registering_a_free_block_raises():
    bm = BlockManager(2, block_size=4, enable_caching=True)
    with pytest.raises(ValueError, match="free"):
        bm.register(0, H[0])


def test_without_caching_nothing_is_kept():
    bm = BlockManager(2, block_size=4)
    s = holding(bm, 4)
    bm.register(s.block_table[0], H[0])
    bm.free(s)
    assert bm.num_cached == 0 and reused(bm, [H[0]]).block_table == []
