"""Per-group-type block-table managers: full attention and sliding window.

The middle layer of the allocator (the layering of vLLM V1's KV cache manager, re-done
here): :class:`~kvpage.cache.manager.KVCacheManager` owns the requests and asks one
manager per KV group to grow, commit, fork and free that group's block tables; each
group manager calls only the public methods of its :class:`BlockPool`. The two kinds
differ in one rule, :meth:`GroupManager.first_needed_block`: a full-attention query
sees every earlier key, a sliding-window query (window ``W``) only the last ``W``
positions, so a sliding group releases blocks wholly below the window (C10) and a
prefix hit in it needs only the window's blocks.

A block table is a ``list[int]`` of block ids (null block 0 on the window-released
prefix) that the caller owns; ``freed`` is the length of that released prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpage.cache.block_pool import NULL_BLOCK_ID, BlockPool, GroupPool
from kvpage.cache.hashing import BlockHash

#: what a group manager allocates from: its own pool, or its view of a shared one
GroupBlocks = BlockPool | GroupPool


@dataclass(slots=True)
class PendingGrowth:
    """What growing one group's table will do (computed before anything changes).

    Attributes:
        release: ids of window-released blocks, in table order (sliding groups only).
        target: the window-released prefix length after the growth, in blocks.
        cow: whether the shared partial last block is copied first.
        num_new: blocks appended to the table.
        demand: net blocks the growth takes from the free queue:
            ``num_new + cow - (released blocks that become free)`` (may be < 0).
    """

    release: list[int]
    target: int
    cow: bool
    num_new: int
    demand: int = 0


@dataclass(slots=True)
class Growth:
    """What growing one group's table did.

    Attributes:
        new_blocks: ids appended to the table.
        copies: copy-on-write ``(src, dst)`` pairs (0 or 1).
        num_released: blocks released by window freeing.
    """

    new_blocks: list[int]
    copies: list[tuple[int, int]]
    num_released: int


class GroupManager:
    """Block tables of one KV group over its pool (base of the two group types).

    Args:
        pool: the group's block pool, or its :class:`GroupPool` view of the pool every
            group shares (then the layer above checks that all groups' demands fit
            together: :attr:`PendingGrowth.demand`, :meth:`start_demand`).
        block_size: tokens per block.

    Attributes:
        pool: the group's pool (read-only use by the layer above: counts, integrity).
        window: the sliding window in tokens, None for full attention.
    """

    window: int | None = None

    def __init__(self, pool: GroupBlocks, block_size: int) -> None:
        self.pool: GroupBlocks = pool
        self.block_size = block_size

    def first_needed_block(self, position: int) -> int:
        """First block that a query at ``position`` (or later) can see."""
        raise NotImplementedError

    # ---- growth (later allocations) -------------------------------------------------
    def prepare_growth(
        self,
        table: list[int],
        freed: int,
        start: int,
        num_new_tokens: int,
        need_blocks: int,
        *,
        check_fit: bool = True,
    ) -> PendingGrowth | None:
        """Plan room for positions ``[start, start + num_new_tokens)`` (all earlier ones
        computed) in a table of ``need_blocks`` blocks; None when the pool lacks blocks
        (``check_fit``; without it the caller checks :attr:`PendingGrowth.demand`).
        No state changes."""
        pool = self.pool
        target = self.first_needed_block(start)
        release = [table[i] for i in range(freed, target) if table[i] != NULL_BLOCK_ID]
        gain = pool.count_exclusive(release) if release else 0
        cow = bool(start % self.block_size and num_new_tokens and pool.is_shared(table[-1]))
        n_new = max(0, need_blocks - len(table))
        demand = n_new + cow - gain
        if check_fit and demand > pool.num_free:
            return None
        return PendingGrowth(release, max(target, freed), cow, n_new, demand)

    def try_append(
        self, table: list[int], start: int, num_new_tokens: int, need_blocks: int
    ) -> list[int] | None:
        """The common case of growth in one step: no window release and no CoW due, and
        room for the blocks to append. Appends them to ``table`` and returns their ids
        (often none); returns None, changing nothing, when the case does not apply (then
        use :meth:`prepare_growth`). Only for full attention (a sliding group may release)."""
        pool = self.pool
        if start % self.block_size and num_new_tokens and pool.is_shared(table[-1]):
            return None
        n_new = need_blocks - len(table)
        if n_new <= 0:
            return []
        if n_new > pool.num_free:
            return None
        ids = pool.allocate_ids(n_new)
        table.extend(ids)
        return ids

    def grow(self, table: list[int], freed: int, pending: PendingGrowth) -> Growth:
        """Carry out ``pending`` on ``table`` (mutated): release window blocks (last first)
        and null their entries, copy a shared last block, append new blocks
        (:meth:`release_window` then :meth:`extend`; groups sharing a pool run every
        group's release before any extend, so the blocks one frees serve another)."""
        self.release_window(table, freed, pending)
        return self.extend(table, pending)

    def release_window(self, table: list[int], freed: int, pending: PendingGrowth) -> None:
        """The release half of :meth:`grow`: window blocks back to the free queue (last
        first), their entries nulled."""
        if pending.release:
            self.pool.release(reversed(pending.release))
        for i in range(freed, pending.target):
            table[i] = NULL_BLOCK_ID

    def extend(self, table: list[int], pending: PendingGrowth) -> Growth:
        """The allocation half of :meth:`grow`: copy a shared last block (CoW) and
        append the new blocks."""
        pool = self.pool
        copies: list[tuple[int, int]] = []
        if pending.cow:
            src = table[-1]
            dst = pool.allocate_ids(1)[0]
            pool.release((src,))  # it was shared: stays used by the other holders
            table[-1] = dst
            copies.append((src, dst))
        ids = pool.allocate_ids(pending.num_new)
        table.extend(ids)
        return Growth(ids, copies, len(pending.release))

    # ---- first allocation -----------------------------------------------------------
    def hit_block_ids(
        self, hashes: Sequence[BlockHash], num_cached_tokens: int
    ) -> list[int] | None:
        """The table prefix a hit of ``num_cached_tokens`` takes (null ids below the
        window of the first computed token), or None if a needed block is not cached."""
        nb = num_cached_tokens // self.block_size
        lo = self.first_needed_block(num_cached_tokens)
        ids = [NULL_BLOCK_ID] * lo
        pool = self.pool
        for i in range(lo, nb):
            bid = pool.cached_block_id(hashes[i])
            if bid is None:
                return None
            ids.append(bid)
        return ids

    def start_demand(self, hit_ids: Sequence[int], num_new: int) -> int:
        """Free-queue blocks that taking ``hit_ids`` plus ``num_new`` new blocks uses
        (free cached hit blocks are revived from it)."""
        return num_new + self.pool.count_free(hit_ids)

    def can_start(self, hit_ids: Sequence[int], num_new: int) -> bool:
        """Whether taking ``hit_ids`` plus ``num_new`` new blocks fits the free queue."""
        return self.start_demand(hit_ids, num_new) <= self.pool.num_free

    def start(self, hit_ids: Sequence[int], num_new: int) -> list[int]:
        """Take the hit blocks (one more holder each) and ``num_new`` new blocks; returns
        the new ids. Call after :meth:`can_start` (groups sharing a pool: every group's
        :meth:`take_hit` first, then :meth:`allocate_new`, so that no group's new
        blocks evict another group's hit)."""
        self.take_hit(hit_ids)
        return self.allocate_new(num_new)

    def take_hit(self, hit_ids: Sequence[int]) -> None:
        """One more holder for each hit block (reviving free ones)."""
        self.pool.touch_ids(hit_ids)

    def allocate_new(self, num_new: int) -> list[int]:
        """``num_new`` new blocks from the free queue; returns their ids."""
        return self.pool.allocate_ids(num_new)

    # ---- commit, fork, free -----------------------------------------------------------
    def commit(self, table: Sequence[int], index: int, block_hash: BlockHash) -> None:
        """Register block ``table[index]`` (unless window-released) as ``block_hash``."""
        bid = table[index]
        if bid != NULL_BLOCK_ID:
            self.pool.cache_block(bid, block_hash)

    def fork(self, table: Sequence[int]) -> None:
        """One more holder for every block of ``table`` (a child shares them)."""
        self.pool.touch_ids(table)

    def free(self, table: Sequence[int]) -> None:
        """Drop the table's hold on its blocks, last block first."""
        self.pool.release(reversed(table))


class FullAttentionManager(GroupManager):
    """A full-attention group: every query sees all earlier keys; nothing is released
    before the request is freed."""

    def first_needed_block(self, position: int) -> int:
        return 0


class SlidingWindowManager(GroupManager):
    """A sliding-window group: the query at position ``i`` sees keys
    ``max(0, i - W + 1) .. i``, so blocks below ``max(0, i - W + 1) // block_size`` are
    released once no later query needs them.

    Args:
        pool, block_size: as :class:`GroupManager`.
        window: ``W``, in tokens (>= 1).
    """

    def __init__(self, pool: GroupBlocks, block_size: int, window: int) -> None:
        super().__init__(pool, block_size)
        self.window = window
        self._w = window

    def first_needed_block(self, position: int) -> int:
        return max(0, position - self._w + 1) // self.block_size


def make_group_manager(pool: GroupBlocks, block_size: int, window: int | None) -> GroupManager:
    """The manager type for a group with sliding window ``window`` (None = full)."""
    if window is None:
        return FullAttentionManager(pool, block_size)
    return SlidingWindowManager(pool, block_size, window)


__all__ = [
    "FullAttentionManager",
    "GroupBlocks",
    "GroupManager",
    "Growth",
    "PendingGrowth",
    "SlidingWindowManager",
    "make_group_manager",
]
