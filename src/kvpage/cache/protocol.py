"""The allocator contract the scheduler and the simulator program against.

:class:`KVAllocator` is what :class:`kvpage.engine.Scheduler` calls and what the
simulator measures; :class:`~kvpage.cache.manager.KVCacheManager` (paged, prefix
caching) and :class:`kvpage.sim.contiguous.ContiguousAllocator` (contiguous
reservation) both implement it, checked statically by mypy and at runtime by
``isinstance`` (the protocols are ``runtime_checkable``). Semantics of every member are
those documented on ``KVCacheManager``; units are tokens unless named blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvpage.cache.allocation import Allocation
from kvpage.cache.explain import CacheMissExplanation
from kvpage.cache.retention import KVRetention
from kvpage.cache.state_pool import StatePool


@runtime_checkable
class AllocatorStats(Protocol):
    """The counters every allocator keeps (names of ``kvpage.cache.CacheStats``)."""

    allocation_failures: int
    allocations: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float: ...


@runtime_checkable
class KVAllocator(Protocol):
    """A KV-cache allocator: room for tokens per request, prefix hits, forks, frees.

    Attributes:
        num_groups: KV groups (one block table per group per request).
        block_size: tokens per block (1 for a slot allocator).
        max_request_tokens: most tokens one request can hold.
    """

    @property
    def num_groups(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_request_tokens(self) -> int: ...

    @property
    def usage(self) -> float:
        """Fraction of the pool held by requests, in [0, 1]."""
        ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def stats(self) -> AllocatorStats: ...

    def get_num_cached_tokens(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int: ...

    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_cached_tokens: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> Allocation | None: ...

    def block_table(self, request_id: str, group: int = 0) -> list[int]: ...

    def block_tables(self, request_id: str) -> list[list[int]]:
        """Copies of every group's block table (``block_table`` of each group)."""
        ...

    def num_allocated_tokens(self, request_id: str) -> int: ...

    def blocks_needed(self, num_tokens: int) -> int: ...

    def commit(
        self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None: ...

    def fork(self, parent_id: str, child_id: str) -> None: ...

    def free(self, request_id: str) -> None: ...

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Drop the positions allocated past the first ``num_tokens`` (rejected
        speculative drafts)."""
        ...

    def check_integrity(self) -> None: ...


@runtime_checkable
class RetentionAllocator(Protocol):
    """What an allocator with a prefix cache adds (``KVCacheManager``): retention
    policies and cache-miss explanations. The scheduler uses them when present."""

    def set_retention(
        self, request_id: str, retention: KVRetention | None, num_prompt_tokens: int
    ) -> None: ...

    def explain_miss(
        self,
        token_ids: Sequence[int],
        num_cached_tokens: int,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        remember_key: bool = True,
    ) -> CacheMissExplanation: ...


@runtime_checkable
class StateAllocator(Protocol):
    """What an allocator of a model with recurrent state layers adds
    (``KVCacheManager`` with a ``StatePool``): where prefill chunks must end for the
    snapshot policy, the live state slot of each sequence and the queued slot copies.
    The scheduler uses them when present and ``state`` is not None."""

    @property
    def state(self) -> StatePool | None: ...

    def state_chunk_end(
        self,
        request_id: str,
        token_ids: Sequence[int],
        start: int,
        end: int,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int: ...

    def state_slot(self, request_id: str) -> int: ...

    def take_state_copies(self) -> list[tuple[int, int]]: ...


@runtime_checkable
class FitAllocator(Protocol):
    """What an allocator whose requests can hold transient blocks adds
    (``KVCacheManager`` with a unified pool and a sliding-window group:
    ``has_transient_blocks``): read-only fit queries, in blocks of the pool. The
    scheduler budgets admission and prefill chunks with them when present and
    ``has_transient_blocks`` is True."""

    @property
    def has_transient_blocks(self) -> bool: ...

    def growth_demand(self, request_id: str, num_tokens: int) -> int: ...

    def admission_demand(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        *,
        num_cached_tokens: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int: ...

    def fit_new_tokens(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        keep_free: int = 0,
        num_cached_tokens: int = 0,
        num_swapped_tokens: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int: ...


@runtime_checkable
class SwapAllocator(Protocol):
    """What swap preemption needs of an allocator (``KVCacheManager``): per KV group
    the blocks a sequence's continuation needs, and a readmission whose first tokens
    the caller copies back (sliding groups: null entries below the window)."""

    def swap_blocks(self, request_id: str, num_tokens: int) -> list[list[int]]: ...

    def allocate_swapped(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_swapped_tokens: int,
        num_new_tokens: int,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> Allocation | None: ...


__all__ = [
    "AllocatorStats",
    "FitAllocator",
    "KVAllocator",
    "RetentionAllocator",
    "StateAllocator",
    "SwapAllocator",
]
