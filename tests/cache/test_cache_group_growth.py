"""Growth of one group's block table at its boundaries (``kvpage.cache.group_managers``):
exactly enough free blocks, copy-on-write due or not, window blocks released to make
room. Written for survivors of the mutmut run in docs/mutation-testing.md."""

from __future__ import annotations

from kvpage.cache import BlockPool
from kvpage.cache.group_managers import FullAttentionManager, SlidingWindowManager


def test_try_append_takes_the_last_free_blocks() -> None:
    pool = BlockPool(4)  # 3 usable
    gm = FullAttentionManager(pool, block_size=2)
    table = pool.allocate_ids(1)  # 2 free left
    assert gm.try_append(table, 2, 4, 3) == [2, 3]  # exactly the free count: taken
    assert table == [1, 2, 3] and pool.num_free == 0
    assert gm.try_append(table, 6, 0, 3) == []  # nothing new needed
    assert gm.try_append(table, 6, 1, 4) is None  # one more than free: refused


def test_try_append_defers_only_a_due_copy_on_write() -> None:
    """None only when the write starts inside a shared last block; a block boundary,
    an unshared last block or a shared earlier block go ahead."""
    pool = BlockPool(8)
    gm = FullAttentionManager(pool, block_size=2)
    table = pool.allocate_ids(3)  # [1, 2, 3]
    pool.touch_ids([table[0], table[1]])  # the first two shared, the last not
    assert gm.try_append(table, 5, 1, 3) == []  # inside block 3 (unshared): go ahead
    pool.touch_ids([table[-1]])  # now the last is shared too
    assert gm.try_append(table, 5, 1, 3) is None  # inside a shared block: CoW due
    assert gm.try_append(table, 6, 1, 4) == [4]  # at a block boundary: no CoW


def test_prepare_growth_boundaries() -> None:
    pool = BlockPool(4)
    gm = FullAttentionManager(pool, block_size=2)
    table = pool.allocate_ids(1)
    plan = gm.prepare_growth(table, 0, 2, 4, 3)  # 2 new blocks, 2 free: fits exactly
    assert plan is not None and plan.num_new == 2 and not plan.cow
    assert gm.prepare_growth(table, 0, 2, 6, 4) is None  # 3 new, 2 free
    pool.touch_ids(table)  # last block shared
    plan = gm.prepare_growth(table, 0, 2, 2, 2)  # starts at a block boundary: no CoW
    assert plan is not None and not plan.cow and plan.num_new == 1
    plan = gm.prepare_growth(table, 0, 1, 1, 1)  # inside the shared block: CoW, 1 free used
    assert plan is not None and plan.cow and plan.num_new == 0


def test_prepare_growth_counts_blocks_the_window_releases() -> None:
    """A full pool still grows a sliding-window table when the blocks leaving the
    window are held by this table alone."""
    pool = BlockPool(4)  # 3 usable
    gm = SlidingWindowManager(pool, block_size=2, window=2)
    table = pool.allocate_ids(3)  # positions 0..5, pool now full
    assert pool.num_free == 0
    plan = gm.prepare_growth(table, 0, 6, 1, 4)  # query 6 sees keys 5, 6: blocks 0, 1 leave
    assert plan is not None and plan.release == table[:2] and plan.num_new == 1
    pool.touch_ids(table[:2])  # shared elsewhere: releasing them frees nothing
    assert gm.prepare_growth(table, 0, 6, 1, 4) is None
