"""Result and counter types of the KVCacheManager, and its per-request record."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpage.cache.hashing import BlockHash
from kvpage.cache.retention import KVRetention


@dataclass(slots=True)
class Allocation:
    """What one ``allocate`` call did.

    Attributes:
        num_cached_tokens: prefix-hit tokens taken on this call (0 on later calls).
        new_blocks: per group, block ids appended to that group's block table.
        copies: per group, copy-on-write ``(src, dst)`` block pairs the backend must
            copy (all layers of the group) BEFORE this step's K/V are written.
        cached_tokens_by_tier: first call only: ``num_cached_tokens`` split by where the
            blocks were found (``"device"``: the pool; ``"host"``, ``"disk"``: promoted
            from that KV tier, ``kvpage.cache.tiered``); None on later calls.
    """

    num_cached_tokens: int
    new_blocks: list[list[int]]
    copies: list[list[tuple[int, int]]]
    cached_tokens_by_tier: dict[str, int] | None = None


@dataclass
class CacheStats:
    """Counters since construction (tokens and blocks; evictions summed over groups).

    Attributes:
        prefix_queries_tokens: prompt tokens of first allocations (prefix lookups taken).
        prefix_hits_tokens: of those, tokens served from the prefix cache.
        prefix_queries: first allocations (requests).
        prefix_hits: first allocations with a non-zero hit.
        evictions: cached blocks whose hash entry was dropped to reuse the block.
        allocation_failures: ``allocate`` calls that returned None.
        allocations: ``allocate`` calls that succeeded.
        blocks_allocated: new blocks handed out (CoW copies included).
        cow_copies: copy-on-write block copies.
        window_blocks_freed: blocks released by sliding-window freeing.
    """

    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    evictions: int = 0
    allocation_failures: int = 0
    allocations: int = 0
    blocks_allocated: int = 0
    cow_copies: int = 0
    window_blocks_freed: int = 0

    @property
    def hit_rate(self) -> float:
        """``prefix_hits_tokens / prefix_queries_tokens`` (0.0 before any query)."""
        q = self.prefix_queries_tokens
        return self.prefix_hits_tokens / q if q else 0.0


@dataclass
class RequestBlocks:
    """The manager's record of one request (internal; read by the integrity check).

    Attributes:
        tables: per KV group, the block table (null block 0 on the window-freed prefix).
        num_tokens: positions allocated (cached + computed + scheduled).
        extra: encoded extra keys (cache_salt, adapter_id) of its block hashes.
        hashes: chained hashes of blocks ``0 .. num_committed-1``.
        num_committed: leading full blocks already committed (hashed).
        freed: per group, leading blocks released by sliding-window freeing.
        retention: the request's retention policy and prompt length, or None.
    """

    tables: list[list[int]]
    num_tokens: int
    extra: bytes
    hashes: list[BlockHash] = field(default_factory=list)
    num_committed: int = 0
    freed: list[int] = field(default_factory=list)
    retention: tuple[KVRetention, int] | None = None


__all__ = ["Allocation", "CacheStats", "RequestBlocks"]
