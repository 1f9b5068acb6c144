"""Block metadata and the free queue of a :class:`~kvpage.cache.block_pool.BlockPool`.

:class:`FreeBlockQueue` is one doubly linked LRU list with O(1) append, appendleft,
popleft and removal from the middle (the design of vLLM v1's
``FreeKVCacheBlockQueue``, re-implemented). :class:`PriorityFreeQueue` is the pool's
free queue: one such list per **retention priority level** (a small fixed number,
:data:`NUM_PRIORITY_LEVELS`), so eviction goes by priority, then LRU: the allocator takes
the head of the lowest non-empty level. Every operation stays O(1) (popleft scans at
most :data:`NUM_PRIORITY_LEVELS` list heads). The levels, in eviction order:

* :data:`PRIORITY_LOW` (0): blocks with no content (head; reused first), then cached
  blocks a retention policy marked low (e.g. decode blocks);
* :data:`PRIORITY_DEFAULT` (1): every other cached block, in LRU order;
* :data:`PRIORITY_HIGH` (2) and :data:`PRIORITY_MAX` (3): *retained* blocks (a
  retention policy raised them for a time; see ``kvpage.cache.retention``).

The priority names and the soft semantics (a priority orders eviction, it never makes a
free block unavailable) follow TensorRT-LLM's ``KvCacheRetentionConfig``; the levels and
their number are kvpage's own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvpage.errors import AllocationError

#: retention priority levels of the free queue (0 .. NUM_PRIORITY_LEVELS - 1)
NUM_PRIORITY_LEVELS = 4
#: evicted first: empty blocks, and cached blocks a policy marked low (decode blocks)
PRIORITY_LOW = 0
#: the level of every cached block without a retention policy
PRIORITY_DEFAULT = 1
#: retained: evicted only when no low or default block is free
PRIORITY_HIGH = 2
#: retained, evicted last
PRIORITY_MAX = 3


class KVBlock:
    """One block's metadata (the KV data lives in the backend's cache tensors).

    Attributes:
        block_id: index into the cache tensors' ``num_blocks`` dimension.
        ref_cnt: number of block tables holding this block.
        block_hash: the chained hash of its contents once committed, else None.
        prev_free, next_free: free-queue links (None when not in the queue).
        level: the free-queue priority level it is in (-1 when not in the queue).
        priority: the level it goes to when freed while cached (a retention policy may
            raise or lower it; back to :data:`PRIORITY_DEFAULT` on eviction or expiry).
        ttl: seconds it stays at a raised ``priority`` after being freed (None = no
            expiry).
        stamp: sequence number of its pending expiry entry (0 = none).
        group: the KV group whose content it holds (its hash is in that group's hash
            map); always 0 in a pool of one group (``BlockPool.add_group``).
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "prev_free",
        "next_free",
        "level",
        "priority",
        "ttl",
        "stamp",
        "group",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None
        self.level = -1
        self.priority = PRIORITY_DEFAULT
        self.ttl: float | None = None
        self.stamp = 0
        self.group = 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h}, prio={self.priority})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) append, appendleft, popleft and
    removal from the middle (sentinel head and tail nodes, id -1 and -2)."""

    def __init__(self, blocks: Sequence[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free

    @property
    def head(self) -> KVBlock:
        """The head sentinel (its ``next_free`` is the first block; for integrity checks)."""
        return self._head

    @property
    def tail(self) -> KVBlock:
        """The tail sentinel (its ``prev_free`` is the last block)."""
        return self._tail

    def popleft(self) -> KVBlock:
        """Remove and return the head (the next block to evict/reuse).

        Raises:
            AllocationError: the queue is empty.
        """
        b = self._head.next_free
        if b is self._tail or b is None:
            raise AllocationError("free queue: expected a free block, got none")
        self.remove(b)
        return b

    def remove(self, b: KVBlock) -> None:
        """Unlink ``b`` (must be in the queue) in O(1)."""
        p, n = b.prev_free, b.next_free
        assert p is not None and n is not None, f"{b!r} is not in the free queue"
        p.next_free = n
        n.prev_free = p
        b.prev_free = b.next_free = None
        self.num_free -= 1

    def append(self, b: KVBlock) -> None:
        """Insert ``b`` at the tail (evicted last)."""
        last = self._tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = self._tail
        self._tail.prev_free = b
        self.num_free += 1

    def appendleft(self, b: KVBlock) -> None:
        """Insert ``b`` at the head (reused first)."""
        first = self._head.next_free
        assert first is not None
        first.prev_free = b
        b.next_free = first
        b.prev_free = self._head
        self._head.next_free = b
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free

    def ids(self) -> list[int]:
        """Block ids from head (next to go) to tail."""
        return [b.block_id for b in self]


class PriorityFreeQueue:
    """The pool's free queue: one doubly linked LRU list per priority level; eviction
    order is level 0 head to tail, then level 1, and so on (see the module docstring).

    The lists are sentinel pairs linked through the blocks' ``prev_free``/``next_free``
    (the :class:`FreeBlockQueue` layout), operated on directly: one Python call per
    operation, and only two counters (``num_free``, ``num_raised``), since these are
    the allocator's inner loop.

    Args:
        blocks: initial free (empty) blocks, put in level :data:`PRIORITY_LOW` in order.

    Attributes:
        num_free: free blocks over all levels.
        num_raised: free blocks in levels above :data:`PRIORITY_DEFAULT` (retained).
    """

    def __init__(self, blocks: Sequence[KVBlock] = ()) -> None:
        self._heads = [KVBlock(-1) for _ in range(NUM_PRIORITY_LEVELS)]
        self._tails = [KVBlock(-2) for _ in range(NUM_PRIORITY_LEVELS)]
        for h, t in zip(self._heads, self._tails):
            h.next_free = t
            t.prev_free = h
        self.num_free = 0
        self.num_raised = 0
        for b in blocks:
            self.append(b, PRIORITY_LOW)

    def __len__(self) -> int:
        return self.num_free

    def popleft(self) -> KVBlock:
        """Remove and return the next block to evict/reuse: the head of the lowest
        non-empty level.

        Raises:
            AllocationError: the queue is empty.
        """
        tails = self._tails
        for i, h in enumerate(self._heads):
            b = h.next_free
            if b is not tails[i] and b is not None:
                self.remove(b)
                return b
        raise AllocationError("free queue: expected a free block, got none")

    def remove(self, b: KVBlock) -> None:
        """Unlink ``b`` (must be in the queue) from its level in O(1)."""
        p, n = b.prev_free, b.next_free
        assert p is not None and n is not None, f"{b!r} is not in the free queue"
        p.next_free = n
        n.prev_free = p
        b.prev_free = b.next_free = None
        if b.level > PRIORITY_DEFAULT:
            self.num_raised -= 1
        b.level = -1
        self.num_free -= 1

    def append(self, b: KVBlock, level: int = PRIORITY_DEFAULT) -> None:
        """Insert ``b`` at the tail of ``level`` (evicted last within the level)."""
        tail = self._tails[level]
        last = tail.prev_free
        assert last is not None
        last.next_free = b
        b.prev_free = last
        b.next_free = tail
        tail.prev_free = b
        if level > PRIORITY_DEFAULT:
            self.num_raised += 1
        b.level = level
        self.num_free += 1

    def appendleft(self, b: KVBlock, level: int = PRIORITY_LOW) -> None:
        """Insert ``b`` at the head of ``level`` (default: level 0, reused first)."""
        head = self._heads[level]
        first = head.next_free
        assert first is not None
        first.prev_free = b
        b.next_free = first
        b.prev_free = head
        head.next_free = b
        if level > PRIORITY_DEFAULT:
            self.num_raised += 1
        b.level = level
        self.num_free += 1

    def level_head(self, level: int) -> KVBlock:
        """The head sentinel of ``level`` (for integrity checks of the back links)."""
        return self._heads[level]

    def level_blocks(self, level: int) -> Iterator[KVBlock]:
        """The blocks of ``level``, head (evicted first) to tail."""
        b = self._heads[level].next_free
        tail = self._tails[level]
        while b is not None and b is not tail:
            yield b
            b = b.next_free

    @property
    def levels(self) -> list[list[KVBlock]]:
        """Per level, its blocks in order (a snapshot, for inspection and tests)."""
        return [list(self.level_blocks(i)) for i in range(NUM_PRIORITY_LEVELS)]

    def __iter__(self) -> Iterator[KVBlock]:
        for i in range(NUM_PRIORITY_LEVELS):
            yield from self.level_blocks(i)

    def ids(self) -> list[int]:
        """Block ids in eviction order (ignoring retention expiry not yet applied)."""
        return [b.block_id for b in self]


__all__ = [
    "NUM_PRIORITY_LEVELS",
    "PRIORITY_DEFAULT",
    "PRIORITY_HIGH",
    "PRIORITY_LOW",
    "PRIORITY_MAX",
    "FreeBlockQueue",
    "KVBlock",
    "PriorityFreeQueue",
]
