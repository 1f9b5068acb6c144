"""The block pool: blocks, ref counts, the LRU free queue, the hash maps.

One pool serves one KV group (``CacheSpec.kv_pool="per_group"``, and every one-group
model) or, shared, every KV group of a model (``"unified"``): then each group sees the
pool through a :class:`GroupPool` (:meth:`BlockPool.add_group`) with its own hash map
and listeners, while block ids, ref counts, the free queue (one global LRU order with
the tail-first and retention rules below) and the retention cap are the pool's. A block
holds one group's content at a time (``KVBlock.group``); evicting it drops the entry in
that group's map.

A pool owns ``num_blocks`` blocks with ids ``0 .. num_blocks-1``. Block 0 is the
reserved *null block*: it is never allocated, never freed and never cached; block
tables use it as a placeholder for blocks released by sliding-window freeing.

Every other block is in exactly one of two states:

* **used**: ``ref_cnt >= 1`` (held by that many block tables), not in the free queue;
* **free**: ``ref_cnt == 0``, in the free queue. A free block may still carry a
  ``block_hash`` (it is *cached*: its KV is intact and a prefix lookup can revive it).

The free queue is ordered for eviction (head = evicted first): one doubly linked LRU
list per retention priority level (``kvpage.cache.free_queue``), the allocator taking
the head of the lowest non-empty level. Allocation pops that block; if it is cached,
its hash entry is removed in the same operation (eviction). Reviving a cached block
removes it from the middle of its list in O(1). The LRU list is the design of vLLM v1's
``FreeKVCacheBlockQueue`` (vLLM docs, "Prefix Caching"), re-implemented here.

Retention (``kvpage.cache.retention``): a block freed while cached goes to the level of
its ``priority`` (default 1). A raised level (2, 3) holds it for ``ttl`` seconds after
it was freed; expiry is applied lazily (a heap of deadlines, checked when blocks are
allocated) and moves the block to the head of the default level. At most
``max_retained_blocks`` free blocks are at a raised level; a block that would exceed
the cap goes to the default level instead (counted in ``num_retention_refused``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvpage.cache.free_queue import (
    NUM_PRIORITY_LEVELS,
    PRIORITY_DEFAULT,
    PRIORITY_LOW,
    FreeBlockQueue,
    KVBlock,
    PriorityFreeQueue,
)
from kvpage.cache.pool_retention import PoolRetention
from kvpage.errors import AllocationError, IntegrityError

NULL_BLOCK_ID = 0
#: share of the usable blocks that may sit free at a raised retention level by default
#: (kvpage's choice: half the pool stays plain LRU for traffic without a policy)
DEFAULT_RETENTION_SHARE = 0.5


class PoolListener(Protocol):
    """Observer of the three pool changes a KV tier or a router needs (the seam of
    docs/architecture.md, "Seams for tiers and events").

    Calls happen synchronously inside the pool method, in pool order; a listener must
    not call back into the pool's mutating methods.
    """

    def on_stored(self, block_id: int, block_hash: bytes) -> None:
        """Block ``block_id`` now holds the content keyed ``block_hash`` (it became a
        prefix-cache hit candidate); called after :meth:`BlockPool.cache_block` succeeds."""

    def on_evicted(self, block_id: int, block_hash: bytes) -> None:
        """Cached block ``block_id`` is about to be reused for new content: its KV data is
        still intact during this call (a tier copies it out here); the hash entry is
        dropped right after."""

    def on_cleared(self) -> None:
        """Every hash entry of the pool was forgotten (``reset_prefix_cache``)."""


class BlockPool(PoolRetention):
    """All blocks of one KV group.

    Args:
        num_blocks: blocks including the null block (>= 2).
        enable_caching: keep a hash -> block map for prefix caching.
        max_retained_blocks: most free blocks at a raised retention level (None = half
            the usable blocks, :data:`DEFAULT_RETENTION_SHARE`; 0 = retention off).
        clock: seconds for retention deadlines (default ``time.monotonic``).

    Attributes:
        blocks: ``blocks[i]`` is the KVBlock with id ``i``.
        free_queue: the free blocks in eviction order.
        cached: block hash -> the block holding that content.
        num_evictions: cached blocks reused for other content so far.
        listeners: :class:`PoolListener` objects told of every store, eviction and
            clear (empty by default: then each change costs one empty-list check).
        num_retention_refused: frees whose raised priority the cap turned to default.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        max_retained_blocks: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if num_blocks < 2:
            raise AllocationError(
                f"num_blocks: expected >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = PriorityFreeQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        self.listeners: list[PoolListener] = []
        #: per KV group sharing the pool: hash map, listeners, evictions (group 0's
        #: are ``cached`` / ``listeners``; more by :meth:`add_group`)
        self.group_maps: list[dict[bytes, KVBlock]] = [self.cached]
        self.group_listeners: list[list[PoolListener]] = [self.listeners]
        self.group_evictions: list[int] = [0]
        self._views: list[GroupPool] = []
        if max_retained_blocks is None:
            max_retained_blocks = int((num_blocks - 1) * DEFAULT_RETENTION_SHARE)
        if not 0 <= max_retained_blocks <= num_blocks - 1:
            raise AllocationError(
                f"max_retained_blocks: expected an int in [0, {num_blocks - 1}], "
                f"got {max_retained_blocks!r}"
            )
        self.max_retained_blocks = max_retained_blocks
        self.num_retention_refused = 0
        self.clock = clock
        #: (deadline, stamp, block) of retained free blocks with a ttl (lazy deletion)
        self._expiry: list[tuple[float, int, KVBlock]] = []
        self._stamp = 0

    # ---- queries ----------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Free blocks, cached-but-unreferenced ones included."""
        return self.free_queue.num_free

    @property
    def num_used(self) -> int:
        """Blocks with ``ref_cnt >= 1``."""
        return self.num_blocks - 1 - self.free_queue.num_free

    @property
    def usage(self) -> float:
        """``num_used / num_usable`` in [0, 1]."""
        return self.num_used / (self.num_blocks - 1)

    def priority_of(self, block_id: int) -> int:
        """The retention priority block ``block_id`` has now (``kvpage.cache.free_queue``)."""
        return self.blocks[block_id].priority

    def ref_count(self, block_id: int) -> int:
        """Block tables holding block ``block_id`` (0 = free)."""
        return self.blocks[block_id].ref_cnt

    def group_of(self, block_id: int) -> int:
        """The KV group whose content block ``block_id`` holds (or last held)."""
        return self.blocks[block_id].group

    def is_shared(self, block_id: int) -> bool:
        """Whether more than one block table holds ``block_id`` (a write needs CoW)."""
        return self.blocks[block_id].ref_cnt > 1

    def count_free(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` (null ids skipped) are free: taking them as a prefix
        hit revives them from the free queue, so each needs a free-queue slot."""
        blocks = self.blocks
        return sum(1 for i in block_ids if i and blocks[i].ref_cnt == 0)

    def count_exclusive(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` (null ids skipped) have exactly one holder: releasing
        them once returns them to the free queue."""
        blocks = self.blocks
        return sum(1 for i in block_ids if i and blocks[i].ref_cnt == 1)

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether some block holds ``block_hash``'s content (no state change)."""
        return block_hash in self.cached

    def cached_hashes(self) -> frozenset[bytes]:
        """Every block hash the pool holds now (a copy of the hash map's keys): the
        state a KV-event publisher announces when it attaches."""
        return frozenset(self.cached)

    def cached_block_id(self, block_hash: bytes) -> int | None:
        """The id of the block holding ``block_hash``'s content, or None."""
        b = self.cached.get(block_hash)
        return None if b is None else b.block_id

    # ---- mutation ---------------------------------------------------------------------
    def allocate(self, n: int, group: int = 0) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, each with ``ref_cnt == 1``,
        for KV group ``group`` (its index in :attr:`group_maps`).

        A cached block taken here is evicted (whichever group's content it held): its
        hash entry is removed at once.

        Raises:
            AllocationError: fewer than ``n`` free blocks (nothing is taken).
        """
        fq = self.free_queue
        if n > fq.num_free:
            raise AllocationError(f"blocks: expected <= {fq.num_free} free, got request for {n}")
        if self._expiry:
            self.expire()
        out = []
        for _ in range(n):
            b = fq.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            b.group = group
            out.append(b)
        return out

    def allocate_ids(self, n: int, group: int = 0) -> list[int]:
        """:meth:`allocate`, returning block ids."""
        return [b.block_id for b in self.allocate(n, group)] if n else []

    def _evict(self, b: KVBlock) -> None:
        """Drop the hash entry of cached block ``b`` just taken for new content (the one
        place where cached content leaves this pool: see docs/architecture.md, seams)."""
        h = b.block_hash
        g = b.group
        listeners = self.group_listeners[g]
        if h is not None and listeners:
            for listener in listeners:
                listener.on_evicted(b.block_id, h)
        cached = self.group_maps[g]
        if h is not None and cached.get(h) is b:
            del cached[h]
        b.block_hash = None
        b.priority = PRIORITY_DEFAULT
        b.ttl = None
        self.num_evictions += 1
        self.group_evictions[g] += 1

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Add one holder to each block (reviving free cached blocks from the queue)."""
        fq = self.free_queue
        for b in blocks:
            if b.ref_cnt == 0:
                fq.remove(b)
            b.ref_cnt += 1

    def touch_ids(self, block_ids: Iterable[int]) -> None:
        """:meth:`touch` by block id; null ids (0) are skipped."""
        blocks = self.blocks
        self.touch([blocks[i] for i in block_ids if i])

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one holder from each block, in the given order.

        Blocks reaching ``ref_cnt == 0`` go to the free-queue tail if cached (so the
        first freed is evicted first), or to the head if not (an empty block is reused
        before any cached content is evicted). Callers free a sequence's blocks in
        reverse order, so its last blocks are evicted first.

        Raises:
            AllocationError: a block is the null block, already free (double free), or
                listed more often than it has holders; nothing is changed then.
        """
        counts: dict[int, int] = {}
        for b in blocks:
            counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for bid, c in counts.items():
            if bid == NULL_BLOCK_ID:
                raise AllocationError("block: expected a data block, got the null block 0")
            ref = self.blocks[bid].ref_cnt
            if c > ref:
                raise AllocationError(
                    f"block {bid}: expected at most {ref} frees (ref_cnt), got {c} (double free)"
                )
        self._release(blocks)

    def release(self, block_ids: Iterable[int]) -> None:
        """Drop the caller's own hold on each block id, in the given order (null ids
        skipped), with the queue placement of :meth:`free`.

        The trusted path of the layer above, which frees only what its block tables
        hold (each id at most once per table it is in), so the double-free scan of
        :meth:`free` is skipped; ``check_integrity`` catches a violation.
        """
        blocks = self.blocks
        self._release([blocks[i] for i in block_ids if i])

    def _release(self, blocks: Sequence[KVBlock]) -> None:
        fq = self.free_queue
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    b.priority = PRIORITY_DEFAULT
                    fq.appendleft(b)
                elif b.priority == PRIORITY_DEFAULT:
                    fq.append(b)
                else:
                    self._release_retained(b)

    def cache_block(self, block: KVBlock | int, block_hash: bytes) -> bool:
        """Register ``block`` (a KVBlock or a block id) as holding ``block_hash``'s content,
        in the hash map of the group the block was allocated for.

        Returns:
            False (no change) if caching is off, the block already has a hash, or another
            block of its group already holds this content; True otherwise.
        """
        if isinstance(block, int):
            block = self.blocks[block]
        cached = self.group_maps[block.group]
        if not self.enable_caching or block_hash in cached:
            return False
        if block.block_hash is not None:
            return False
        block.block_hash = block_hash
        cached[block_hash] = block
        for listener in self.group_listeners[block.group]:
            listener.on_stored(block.block_id, block_hash)
        return True

    def add_group(self) -> GroupPool:
        """A view of this pool for one more KV group sharing it: its own hash map,
        listeners and eviction count over the pool's blocks and free queue. The first
        call returns the view of group 0 (whose map is :attr:`cached`)."""
        g = len(self._views)
        if g:
            self.group_maps.append({})
            self.group_listeners.append([])
            self.group_evictions.append(0)
        view = GroupPool(self, g)
        self._views.append(view)
        return view

    def num_used_by_group(self) -> list[int]:
        """Per group (:attr:`group_maps` order), blocks with ``ref_cnt >= 1`` that hold
        its content (O(num_blocks); for reports and tests)."""
        out = [0] * len(self.group_maps)
        for b in self.blocks[1:]:
            if b.ref_cnt:
                out[b.group] += 1
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every hash (of every group) if no block is used; returns False (no
        change) otherwise."""
        if self.num_used:
            return False
        for cached in self.group_maps:
            for b in cached.values():
                b.block_hash = None
            cached.clear()
        fq = self.free_queue
        order = list(fq)  # nothing is cached now: every free block is empty
        for b in order:
            fq.remove(b)
            b.priority, b.ttl, b.stamp = PRIORITY_DEFAULT, None, 0
            fq.append(b, PRIORITY_LOW)
        self._expiry.clear()
        for listeners in self.group_listeners:
            for listener in listeners:
                listener.on_cleared()
        return True

    # ---- checking ---------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Verify the pool's invariants.

        Raises:
            IntegrityError: with the numbers that disagree (free-queue length vs links,
                a used block in the queue, a free block missing from it, a hash entry
                pointing to a block with another hash, ...).
        """
        seen: set[int] = set()
        fq = self.free_queue
        for level in range(NUM_PRIORITY_LEVELS):
            prev = fq.level_head(level)
            for b in fq.level_blocks(level):
                if b.prev_free is not prev:
                    raise IntegrityError(f"free queue: broken back link at block {b.block_id}")
                if b.block_id in seen:
                    raise IntegrityError(f"free queue: block {b.block_id} appears twice")
                if b.block_id == NULL_BLOCK_ID:
                    raise IntegrityError("free queue: expected no null block, got block 0")
                if b.ref_cnt != 0:
                    raise IntegrityError(
                        f"free queue: block {b.block_id} expected ref_cnt 0, got {b.ref_cnt}"
                    )
                if b.level != level or (level > PRIORITY_LOW and b.block_hash is None):
                    raise IntegrityError(
                        f"free queue: block {b.block_id} in level {level} with level "
                        f"{b.level}, hash {b.block_hash is not None} (empty blocks are level 0)"
                    )
                seen.add(b.block_id)
                prev = b
        raised = sum(1 for b in self.free_queue if b.level > PRIORITY_DEFAULT)
        if raised != self.free_queue.num_raised:
            raise IntegrityError(
                f"free queue: expected num_raised {self.free_queue.num_raised}, got {raised} "
                "blocks above the default level"
            )
        if self.num_retained > self.max_retained_blocks:
            raise IntegrityError(
                f"retention: expected <= {self.max_retained_blocks} retained free blocks, "
                f"got {self.num_retained}"
            )
        if len(seen) != self.free_queue.num_free:
            raise IntegrityError(
                f"free queue: expected length {self.free_queue.num_free}, "
                f"got {len(seen)} linked blocks"
            )
        for b in self.blocks[1:]:
            if b.ref_cnt < 0:
                raise IntegrityError(f"block {b.block_id}: expected ref_cnt >= 0, got {b.ref_cnt}")
            if b.ref_cnt == 0 and b.block_id not in seen:
                raise IntegrityError(f"block {b.block_id}: ref_cnt 0 but not in the free queue")
            if not 0 <= b.group < len(self.group_maps):
                raise IntegrityError(
                    f"block {b.block_id}: group {b.group} expected in [0, {len(self.group_maps)})"
                )
            if b.block_hash is not None and self.group_maps[b.group].get(b.block_hash) is not b:
                where = f" in group {b.group}" if len(self.group_maps) > 1 else ""
                raise IntegrityError(f"block {b.block_id}: has a hash but no matching entry{where}")
        nb = self.null_block
        if nb.ref_cnt != 0 or nb.block_hash is not None or nb.prev_free is not None:
            raise IntegrityError(f"null block: expected untouched, got {nb!r}")
        for g, cached in enumerate(self.group_maps):
            name = f"hash map of group {g}" if len(self.group_maps) > 1 else "hash map"
            for h, b in cached.items():
                if b.block_hash != h or b.group != g:
                    of = f" of group {b.group}" if b.group != g else ""
                    raise IntegrityError(
                        f"{name}: entry {h.hex()[:8]} points to block {b.block_id}{of} "
                        f"whose hash is {b.block_hash.hex()[:8] if b.block_hash else None}"
                    )
        if sum(self.group_evictions) != self.num_evictions:
            raise IntegrityError(
                f"evictions: expected per-group sum {sum(self.group_evictions)} == "
                f"{self.num_evictions}"
            )
        free = self.free_queue.num_free
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        if free + used != self.num_usable:
            raise IntegrityError(
                f"blocks: expected free + used == {self.num_usable}, got {free} + {used}"
            )


class GroupPool:
    """One KV group's view of a shared :class:`BlockPool` (``BlockPool.add_group``):
    the methods a group manager, a prefix lookup, a KV-event publisher or a miss
    explanation call on "its pool", with this group's hash map and listeners; counts,
    ref counts, the free queue and retention are the shared pool's.

    Attributes:
        shared: the pool.
        group: this group's index in ``shared.group_maps``.
        cached: this group's hash map (block hash -> block).
        listeners: :class:`PoolListener` objects told of this group's stores and
            evictions (and of every clear).
    """

    def __init__(self, shared: BlockPool, group: int) -> None:
        self.shared = shared
        self.group = group
        self.cached = shared.group_maps[group]
        self.listeners = shared.group_listeners[group]
        self.blocks = shared.blocks
        self.enable_caching = shared.enable_caching

    # ---- this group's --------------------------------------------------------------
    @property
    def num_evictions(self) -> int:
        """This group's cached blocks reused for other content so far."""
        return self.shared.group_evictions[self.group]

    def is_cached(self, block_hash: bytes) -> bool:
        """Whether a block of this group holds ``block_hash``'s content."""
        return block_hash in self.cached

    def cached_hashes(self) -> frozenset[bytes]:
        """The block hashes this group holds now (a copy)."""
        return frozenset(self.cached)

    def cached_block_id(self, block_hash: bytes) -> int | None:
        """The id of this group's block holding ``block_hash``'s content, or None."""
        b = self.cached.get(block_hash)
        return None if b is None else b.block_id

    def allocate(self, n: int) -> list[KVBlock]:
        """``BlockPool.allocate`` for this group."""
        return self.shared.allocate(n, self.group)

    def allocate_ids(self, n: int) -> list[int]:
        """``BlockPool.allocate_ids`` for this group."""
        return self.shared.allocate_ids(n, self.group)

    def cache_block(self, block: KVBlock | int, block_hash: bytes) -> bool:
        """``BlockPool.cache_block`` (the block was allocated for this group)."""
        return self.shared.cache_block(block, block_hash)

    # ---- the shared pool's ---------------------------------------------------------
    @property
    def free_queue(self) -> PriorityFreeQueue:
        """The shared pool's free queue (read it only)."""
        return self.shared.free_queue

    @property
    def num_blocks(self) -> int:
        """Blocks of the shared pool, null block included."""
        return self.shared.num_blocks

    @property
    def num_usable(self) -> int:
        """Usable blocks of the shared pool."""
        return self.shared.num_usable

    @property
    def num_free(self) -> int:
        """Free blocks of the shared pool (every group allocates from them)."""
        return self.shared.num_free

    @property
    def num_used(self) -> int:
        """Used blocks of the shared pool (all groups)."""
        return self.shared.num_used

    @property
    def usage(self) -> float:
        """The shared pool's usage."""
        return self.shared.usage

    @property
    def num_retained(self) -> int:
        """The shared pool's retained free blocks."""
        return self.shared.num_retained

    @property
    def max_retained_blocks(self) -> int:
        """The shared pool's retention cap."""
        return self.shared.max_retained_blocks

    def priority_of(self, block_id: int) -> int:
        """``BlockPool.priority_of``."""
        return self.shared.priority_of(block_id)

    def ref_count(self, block_id: int) -> int:
        """``BlockPool.ref_count``."""
        return self.shared.ref_count(block_id)

    def is_shared(self, block_id: int) -> bool:
        """``BlockPool.is_shared``."""
        return self.shared.is_shared(block_id)

    def count_free(self, block_ids: Iterable[int]) -> int:
        """``BlockPool.count_free``."""
        return self.shared.count_free(block_ids)

    def count_exclusive(self, block_ids: Iterable[int]) -> int:
        """``BlockPool.count_exclusive``."""
        return self.shared.count_exclusive(block_ids)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """``BlockPool.touch``."""
        self.shared.touch(blocks)

    def touch_ids(self, block_ids: Iterable[int]) -> None:
        """``BlockPool.touch_ids``."""
        self.shared.touch_ids(block_ids)

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """``BlockPool.free``."""
        self.shared.free(blocks)

    def release(self, block_ids: Iterable[int]) -> None:
        """``BlockPool.release``."""
        self.shared.release(block_ids)

    def set_retention(self, block_ids: Iterable[int], priority: int, ttl: float | None) -> None:
        """``BlockPool.set_retention``."""
        self.shared.set_retention(block_ids, priority, ttl)

    def reset_prefix_cache(self) -> bool:
        """``BlockPool.reset_prefix_cache`` (every group's hashes: a reset is global)."""
        return self.shared.reset_prefix_cache()

    def check_integrity(self) -> None:
        """``BlockPool.check_integrity``."""
        self.shared.check_integrity()


__all__ = [
    "DEFAULT_RETENTION_SHARE",
    "NULL_BLOCK_ID",
    "BlockPool",
    "GroupPool",
    "FreeBlockQueue",
    "KVBlock",
    "PoolListener",
]
