"""The read-only queries of :class:`~kvpage.cache.manager.KVCacheManager` (a base
class, split from manager.py to keep modules small; the state it reads is set up by
``KVCacheManager.__init__``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpage.cache.allocation import CacheStats, RequestBlocks
from kvpage.cache.block_pool import BlockPool
from kvpage.cache.explain import EvictionRecord, KeyRecord
from kvpage.cache.group_managers import GroupManager
from kvpage.cache.hashing import BlockHash
from kvpage.cache.integrity import check_manager_integrity
from kvpage.errors import AllocationError

if TYPE_CHECKING:
    from kvpage.cache.tiered import TieredCache


class ManagerQueries:
    """Queries of a :class:`~kvpage.cache.manager.KVCacheManager` (see there for the
    attributes)."""

    # state owned by KVCacheManager.__init__
    block_size: int
    enable_prefix_caching: bool
    hash_seed: int
    windows: list[int | None]
    num_groups: int
    clock: Callable[[], float]
    eviction_record: EvictionRecord
    tiers: TieredCache | None
    _groups: list[GroupManager]
    _pools: list[BlockPool]
    _keys: KeyRecord
    _simple: bool
    _root: BlockHash
    _reqs: dict[str, RequestBlocks]
    _stats: CacheStats
    _peek_memo: tuple[bytes, list[int], list[BlockHash]] | None

    @property
    def pools(self) -> list[BlockPool]:
        """The per-group pools, for inspection (tests, debugging); mutate them only
        through this manager."""
        return list(self._pools)

    @property
    def prefix_pools(self) -> list[BlockPool]:
        """The pools whose hash maps decide a prefix hit: those of the full-attention
        groups (all pools when every group is sliding-window). A KV-event publisher
        (``kvpage.routing``) listens to these; mutate them only through this manager."""
        full = [gm.pool for gm in self._groups if gm.window is None]
        return full or list(self._pools)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, max over groups, in [0, 1]; cached
        blocks nobody holds count as free."""
        return max(p.usage for p in self._pools)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (cached-but-unreferenced included), min over groups."""
        return min(p.num_free for p in self._pools)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests, max over groups."""
        return max(p.num_used for p in self._pools)

    @property
    def num_retained_blocks(self) -> int:
        """Free blocks held at a raised retention priority, max over groups."""
        return max(p.num_retained for p in self._pools)

    @property
    def max_retained_blocks(self) -> int:
        """The retention cap per group (blocks)."""
        return self._pools[0].max_retained_blocks

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        return replace(self._stats, evictions=sum(p.num_evictions for p in self._pools))

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` holds blocks (allocated and not freed)."""
        return request_id in self._reqs

    @property
    def num_requests(self) -> int:
        """Requests holding blocks."""
        return len(self._reqs)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """A copy of the request's block table in ``group`` (null block 0 marks blocks
        released by sliding-window freeing). Raises AllocationError if unknown."""
        return list(self._get(request_id).tables[group])

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Copies of the request's block tables, one per group (the scheduler's per-step
        call: one lookup for every group). Raises AllocationError if unknown."""
        return [list(t) for t in self._get(request_id).tables]

    def num_allocated_tokens(self, request_id: str) -> int:
        """Tokens the request has room for (cached + allocated)."""
        return self._get(request_id).num_tokens

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks one request needs in each group to hold ``num_tokens`` allocated in one
        call: ``ceil(num_tokens / block_size)`` (max over groups)."""
        return -(-max(num_tokens, 0) // self.block_size)

    def check_integrity(self) -> None:
        """Verify pool and table invariants. Raises IntegrityError with the numbers."""
        check_manager_integrity(
            self._pools, self._reqs, self.block_size, self.enable_prefix_caching
        )

    def _get(self, request_id: str) -> RequestBlocks:
        req = self._reqs.get(request_id)
        if req is None:
            raise AllocationError(f"request_id: expected an allocated request, got {request_id!r}")
        return req


__all__ = ["ManagerQueries"]
