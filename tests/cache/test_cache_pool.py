"""BlockPool / FreeBlockQueue behaviour and the integrity checks' error messages."""

from __future__ import annotations

import pytest
from cache_helpers import make_spec

from kvpage.cache import BlockPool, FreeBlockQueue, KVBlock, KVCacheManager
from kvpage.errors import AllocationError, IntegrityError


def test_free_queue_o1_removal_keeps_order() -> None:
    blocks = [KVBlock(i) for i in range(1, 6)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])  # from the middle
    assert q.ids() == [1, 2, 4, 5] and len(q) == 4
    q.remove(blocks[0])  # the head
    q.remove(blocks[4])  # the tail
    assert q.ids() == [2, 4]
    q.appendleft(blocks[0])
    q.append(blocks[4])
    assert q.ids() == [1, 2, 4, 5]
    assert q.popleft() is blocks[0] and q.ids() == [2, 4, 5]
    assert blocks[0].prev_free is None and blocks[0].next_free is None
    for _ in range(3):
        q.popleft()
    with pytest.raises(AllocationError):
        q.popleft()


def test_pool_rejects_too_few_blocks() -> None:
    with pytest.raises(AllocationError, match="num_blocks"):
        BlockPool(1)
    pool = BlockPool(3)
    with pytest.raises(AllocationError):
        pool.allocate(3)  # only 2 usable: nothing taken
    assert pool.num_free == 2


def test_eviction_order_lru_last_blocks_first() -> None:
    mgr = KVCacheManager(make_spec(9, 2))  # 8 usable blocks
    pool = mgr.pools[0]
    a, b = list(range(6)), list(range(100, 106))
    for rid, toks in (("a", a), ("b", b)):
        assert mgr.allocate(rid, toks, 6) is not None
        mgr.commit(rid, toks, 6)
    ta, tb = mgr.block_table("a"), mgr.block_table("b")
    mgr.free("a")
    mgr.free("b")
    # 2 never-used blocks first, then a's blocks last-first, then b's
    order = pool.free_queue.ids()
    assert order[2:] == ta[::-1] + tb[::-1]
    assert all(pool.blocks[x].block_hash is None for x in order[:2])
    # a partial (uncached) block goes to the head: reused before any cached block
    assert mgr.allocate("c", [7, 7, 7], 3) is not None
    tc = mgr.block_table("c")
    mgr.commit("c", [7, 7, 7], 3)  # block 0 of c is cached, block 1 (partial) is not
    mgr.free("c")
    assert pool.free_queue.ids()[0] == tc[1]
    assert pool.free_queue.ids()[-1] == tc[0]
    # a hit revives a's first block from the middle of the queue
    assert mgr.get_num_cached_tokens(a) == 4
    before = mgr.stats.evictions
    assert mgr.allocate("d", a, 2, num_cached_tokens=4) is not None
    assert mgr.block_table("d")[:2] == ta[:2]
    assert mgr.stats.evictions == before  # the uncached head block served the new one
    mgr.check_integrity()


def test_integrity_errors_carry_numbers() -> None:
    mgr = KVCacheManager(make_spec(6, 2))
    assert mgr.allocate("a", [1, 2, 3], 3) is not None
    mgr.commit("a", [1, 2, 3], 3)
    mgr.check_integrity()
    pool = mgr.pools[0]
    b = pool.blocks[mgr.block_table("a")[0]]
    b.ref_cnt += 1
    with pytest.raises(IntegrityError, match=r"ref_cnt 2 but 1 block tables hold it"):
        mgr.check_integrity()
    b.ref_cnt -= 1
    h = b.block_hash
    assert h is not None
    pool.cached[h] = pool.blocks[5]
    with pytest.raises(IntegrityError, match="hash"):
        mgr.check_integrity()
    pool.cached[h] = b
    pool.free_queue.num_free += 1
    with pytest.raises(IntegrityError, match=r"expected length 4, got 3"):
        mgr.check_integrity()
    pool.free_queue.num_free -= 1
    mgr._reqs["a"].num_tokens = 9
    with pytest.raises(IntegrityError, match=r"expected 5 blocks for 9 tokens, got 2"):
        mgr.check_integrity()
    mgr._reqs["a"].num_tokens = 3
    mgr.check_integrity()


def test_hybrid_usage_is_the_binding_group() -> None:
    mgr = KVCacheManager(make_spec(11, 2, windows=(None, 2)))  # 10 usable blocks per group
    toks = list(range(8))
    assert mgr.allocate("a", toks, 8) is not None
    mgr.commit("a", toks, 8)
    for p in range(8, 12):  # decode: the sliding group releases, the full group grows
        toks.append(p)
        assert mgr.allocate("a", toks, 1) is not None
        mgr.commit("a", toks, p + 1)
    full, sliding = mgr.pools
    assert full.num_used == 6 and sliding.num_used == 1  # query 11 sees keys 10, 11
    assert mgr.usage == pytest.approx(0.6)  # max over groups
    assert mgr.num_free_blocks == 4  # min over groups
    assert mgr.stats.window_blocks_freed == 5
    mgr.check_integrity()


class _Recorder:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.events: list[tuple] = []

    def on_stored(self, block_id: int, block_hash: bytes) -> None:
        self.events.append(("stored", block_id, block_hash))

    def on_evicted(self, block_id: int, block_hash: bytes) -> None:
        # the hash entry must still be there while the listener runs (a tier copies out here)
        assert self.pool.cached_block_id(block_hash) == block_id
        self.events.append(("evicted", block_id, block_hash))

    def on_cleared(self) -> None:
        self.events.append(("cleared",))


def test_pool_listeners_see_store_evict_clear_in_order():
    pool = BlockPool(3)
    rec = _Recorder(pool)
    pool.listeners.append(rec)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h1")
    assert not pool.cache_block(b, b"h1")  # duplicate content: no event
    pool.free([a, b])  # b (uncached) to the head, a (cached) to the tail
    pool.allocate(2)  # takes b, then evicts a
    assert rec.events == [("stored", a.block_id, b"h1"), ("evicted", a.block_id, b"h1")]
    pool.free(pool.blocks[1:])
    pool.cache_block(1, b"h2")
    assert pool.reset_prefix_cache()
    assert rec.events[-2:] == [("stored", 1, b"h2"), ("cleared",)]


# ---- found by mutation testing (docs/mutation-testing.md): exact counts, return values
# and messages that no other test pinned down ----------------------------------------------


def test_count_free_and_exclusive_count_each_block_once() -> None:
    """count_free / count_exclusive: one per matching block, null ids skipped, exact
    ref-count comparisons (0 and 1, not 2)."""
    pool = BlockPool(6)  # blocks 1..5
    a, b, c = pool.allocate(3)  # ref 1 each
    pool.touch([b, b])  # b: ref 3
    pool.touch([c])  # c: ref 2
    ids = [0, a.block_id, b.block_id, c.block_id, 4, 5]  # 4, 5 free; 0 the null block
    assert pool.count_free(ids) == 2
    assert pool.count_exclusive(ids) == 1  # only a
    assert pool.count_free([0, 0]) == 0 and pool.count_exclusive([0]) == 0
    pool.free([c])  # c: ref 1
    assert pool.count_exclusive(ids) == 2


def test_evictions_are_counted_one_each() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        assert pool.cache_block(blk, bytes([i + 1]) * 8)
    pool.free(blocks)
    assert pool.num_evictions == 0
    pool.allocate(2)  # takes two cached blocks: two evictions
    assert pool.num_evictions == 2
    pool.allocate(1)
    assert pool.num_evictions == 3


def test_cache_block_and_reset_report_no_change() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"h1") is True
    assert pool.cache_block(a, b"h2") is False  # a already holds content
    assert pool.cached_block_id(b"h2") is None
    assert pool.reset_prefix_cache() is False  # blocks in use: nothing forgotten
    assert pool.cached_block_id(b"h1") == a.block_id
    pool.free([a, b])
    assert pool.reset_prefix_cache() is True and pool.cached_block_id(b"h1") is None


def test_free_of_the_null_block_names_it() -> None:
    pool = BlockPool(3)
    with pytest.raises(
        AllocationError, match=r"^block: expected a data block, got the null block 0$"
    ):
        pool.free([pool.null_block])


def test_pool_integrity_messages() -> None:
    """Each pool invariant broken alone gives its own message (block 1 included: the
    loop over data blocks starts there)."""
    pool = BlockPool(4)
    a, b = pool.allocate(2)  # blocks 1, 2; block 3 free
    pool.check_integrity()

    def broken(pattern: str) -> None:
        with pytest.raises(IntegrityError, match=pattern):
            pool.check_integrity()

    a.ref_cnt = -1
    broken(r"^block 1: expected ref_cnt >= 0, got -1$")
    a.ref_cnt = 0  # free but not queued
    broken(r"^block 1: ref_cnt 0 but not in the free queue$")
    a.ref_cnt = 1
    nb = pool.null_block
    for attr, bad in (("ref_cnt", 1), ("block_hash", b"x"), ("prev_free", a)):
        good = getattr(nb, attr)
        setattr(nb, attr, bad)
        broken(r"^null block: expected untouched, got ")
        setattr(nb, attr, good)
    pool.check_integrity()
    assert pool.cache_block(a, bytes(range(16)))
    pool.cached[bytes(range(16))] = b  # entry -> a block without a hash
    broken(r"^block 1: has a hash but no matching entry$")
    del pool.cached[bytes(range(16))]
    a.block_hash = None
    pool.cached[bytes(range(16))] = b
    broken(r"^hash map: entry 00010203 points to block 2 whose hash is None$")
    b.block_hash = bytes(range(1, 17))
    pool.cached[bytes(range(1, 17))] = b
    broken(r"^hash map: entry 00010203 points to block 2 whose hash is 01020304$")
    del pool.cached[bytes(range(16))]
    pool.check_integrity()
    c = pool.blocks[3]
    c.ref_cnt = 1  # queued but held
    broken(r"^free queue: block 3 expected ref_cnt 0, got 1$")
    c.ref_cnt = 0
    pool.free_queue.append(nb)
    broken(r"^free queue: expected no null block, got block 0$")
    pool.free_queue.remove(nb)
    pool.check_integrity()
    c.prev_free = a
    broken(r"^free queue: broken back link at block 3$")
    c.prev_free = pool.free_queue._heads[0]  # level 0: empty blocks
    pool.check_integrity()


def test_smallest_pool_and_allocation_messages() -> None:
    pool = BlockPool(2)  # the smallest pool: one data block
    assert pool.num_free == 1 and pool.allocate_ids(1) == [1]
    with pytest.raises(AllocationError, match=r"^blocks: expected <= 0 free, got request for 1$"):
        pool.allocate(1)
    q = FreeBlockQueue()
    with pytest.raises(AllocationError, match=r"^free queue: expected a free block, got none$"):
        q.popleft()
    blk = KVBlock(7)
    q.appendleft(blk)  # into an empty queue: the head sentinel links to the tail
    assert q.ids() == [7] and q.popleft() is blk and q.ids() == []


def test_manager_integrity_messages() -> None:
    """The manager's table checks name the request, group and numbers (an id equal to
    num_blocks is outside the pool). Written for mutmut survivors."""
    mgr = KVCacheManager(make_spec(6, 2))
    assert mgr.allocate("a", [1, 2, 3], 3) is not None
    mgr.commit("a", [1, 2, 3], 3)
    mgr.check_integrity()
    req = mgr._reqs["a"]
    table, first = req.tables[0], req.tables[0][0]
    table[0] = 6
    with pytest.raises(
        IntegrityError, match=r"^request 'a' group 0: block id expected in \[0, 6\), got 6$"
    ):
        mgr.check_integrity()
    table[0] = 0
    with pytest.raises(
        IntegrityError,
        match=r"^request 'a' group 0: table\[0\] = 0 but the window-freed prefix is 0 blocks$",
    ):
        mgr.check_integrity()
    table[0] = first
    hashes = list(req.hashes)
    req.hashes.clear()
    with pytest.raises(IntegrityError, match=r"^request 'a': expected 1 block hashes, got 0$"):
        mgr.check_integrity()
    req.hashes.extend(hashes)
    mgr.check_integrity()
