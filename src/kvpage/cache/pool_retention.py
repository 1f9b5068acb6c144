"""The retention half of :class:`~kvpage.cache.block_pool.BlockPool`: priority marks,
the cap on retained free blocks and lazy TTL expiry (rules: ``kvpage.cache.retention``
and the ``block_pool`` module docstring). A mixin, so the pool's hot paths stay one
class; it uses only the pool's own attributes declared below."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from kvpage.cache.free_queue import (
    NUM_PRIORITY_LEVELS,
    PRIORITY_DEFAULT,
    PRIORITY_LOW,
    KVBlock,
    PriorityFreeQueue,
)
from kvpage.errors import AllocationError


class PoolRetention:
    """Retention methods of ``BlockPool`` (see the module docstring)."""

    blocks: list[KVBlock]
    free_queue: PriorityFreeQueue
    max_retained_blocks: int
    num_retention_refused: int
    clock: Callable[[], float]
    _expiry: list[tuple[float, int, KVBlock]]
    _stamp: int

    @property
    def num_retained(self) -> int:
        """Free blocks at a raised retention level (<= ``max_retained_blocks``)."""
        return self.free_queue.num_raised

    def _release_retained(self, b: KVBlock) -> None:
        """Queue cached block ``b`` at its non-default priority (cap and ttl applied)."""
        level = b.priority
        if level > PRIORITY_DEFAULT:
            if self.free_queue.num_raised >= self.max_retained_blocks:
                self.num_retention_refused += 1
                b.priority = level = PRIORITY_DEFAULT
                b.ttl = None
            elif b.ttl is not None:
                self._stamp += 1
                b.stamp = self._stamp
                heapq.heappush(self._expiry, (self.clock() + b.ttl, self._stamp, b))
        self.free_queue.append(b, level)

    # ---- retention --------------------------------------------------------------------
    def set_retention(self, block_ids: Iterable[int], priority: int, ttl: float | None) -> None:
        """Mark held blocks (null ids skipped) for the level they take when freed.

        A raise (``priority > 1``) keeps the higher of the block's current and the new
        priority and the longer ttl (None = no expiry wins); a lowering
        (``priority == 0``) applies only to a block at the default priority, so one
        request's low decode blocks never undo another's retention.

        Raises:
            AllocationError: ``priority`` outside ``[0, NUM_PRIORITY_LEVELS)``.
        """
        if not 0 <= priority < NUM_PRIORITY_LEVELS:
            raise AllocationError(
                f"priority: expected an int in [0, {NUM_PRIORITY_LEVELS - 1}], got {priority!r}"
            )
        blocks = self.blocks
        for i in block_ids:
            if not i:
                continue
            b = blocks[i]
            if priority > PRIORITY_DEFAULT:
                if b.priority > PRIORITY_DEFAULT:
                    b.ttl = None if b.ttl is None or ttl is None else max(b.ttl, ttl)
                else:
                    b.ttl = ttl
                b.priority = max(b.priority, priority)
            elif priority == PRIORITY_LOW and b.priority == PRIORITY_DEFAULT:
                b.priority = PRIORITY_LOW

    def expire(self, now: float | None = None) -> int:
        """Move retained free blocks whose deadline passed to the head of the default
        level (their last use is at least ``ttl`` ago). Called lazily by
        :meth:`allocate`; returns how many moved."""
        heap = self._expiry
        if not heap:
            return 0
        t = self.clock() if now is None else now
        moved = 0
        fq = self.free_queue
        while heap and heap[0][0] <= t:
            _, stamp, b = heapq.heappop(heap)
            if b.stamp != stamp or b.level <= PRIORITY_DEFAULT:
                continue  # revived, evicted or re-queued since: a stale entry
            fq.remove(b)
            b.priority = PRIORITY_DEFAULT
            b.ttl = None
            b.stamp = 0
            fq.appendleft(b, PRIORITY_DEFAULT)
            moved += 1
        return moved


__all__ = ["PoolRetention"]
