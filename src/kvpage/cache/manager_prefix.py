"""Prefix lookup, KV tiers, cache-miss explanations and retention of
:class:`~kvpage.cache.manager.KVCacheManager` (a base class split from manager.py along
the seam to ``kvpage.cache.tiered``, ``kvpage.cache.explain`` and
``kvpage.cache.retention``), and :class:`TierEvictionRecorder`, which records the KV
tiers' drops for miss explanations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpage.cache.allocation import RequestBlocks
from kvpage.cache.explain import CacheMissExplanation, EvictionRecord, explain_first_miss
from kvpage.cache.hashing import BlockHash, encode_extra_keys
from kvpage.cache.manager_queries import ManagerQueries
from kvpage.cache.prefix import longest_hit
from kvpage.cache.retention import KVRetention
from kvpage.errors import SpecError

if TYPE_CHECKING:
    from kvpage.cache.tiered import TieredCache

#: a tier's drop reason (``kvpage.cache.tier_store``) -> the eviction policy a miss
#: explanation names; ``stored_in_pool`` is not an eviction (the pool holds the block)
TIER_DROP_POLICY = {
    "capacity": "lru",
    "corrupt": "corrupt",
    "write_error": "write_error",
    "cleared": "reset",
}


class TierEvictionRecorder:
    """A ``TierListener`` (``kvpage.cache.tier_store``) that records each block a KV
    tier drops in the manager's :class:`~kvpage.cache.explain.EvictionRecord`, with the
    tier's name and the policy of :data:`TIER_DROP_POLICY` (a capacity drop is
    ``lru``), so a later miss on it says ``evicted`` from that tier. A block promoted
    into the pool, or computed again by the pool (``stored_in_pool``), has its record
    forgotten: it is cached again, and an older record must not explain a later miss.

    Args:
        record: where drops go.
        clock: ``time.monotonic`` by default (the manager's clock).
    """

    def __init__(self, record: EvictionRecord, clock: Callable[[], float] = time.monotonic):
        self.record = record
        self._clock = clock

    def on_demoted(self, block_hash: bytes, tier: str) -> None:
        """Nothing: the pool's eviction that demoted it is already recorded."""

    def on_promoted(self, block_hash: bytes, tier: str) -> None:
        self.record.forget(block_hash)

    def on_dropped(self, block_hash: bytes, tier: str, reason: str) -> None:
        if reason == "stored_in_pool":
            self.record.forget(block_hash)
            return
        policy = TIER_DROP_POLICY.get(reason, reason)
        self.record.record_eviction(block_hash, tier, policy, self._clock())


class ManagerPrefix(ManagerQueries):
    """Prefix lookup, tiers, explanations and retention of a
    :class:`~kvpage.cache.manager.KVCacheManager` (see there)."""

    def get_num_cached_tokens(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int:
        """Prefix-cache hit for a new request, in tokens; changes no block, table or
        stat (it only remembers the hashes it computed, for the ``allocate`` that follows).

        The hit is a multiple of ``block_size``, covers only committed blocks, and is at
        most ``len(token_ids) - 1`` rounded down to a block (one token is always
        computed, C05). Full-attention groups need blocks 0 .. hit-1 cached; a
        sliding-window group needs only the blocks within the window of the first
        computed token. Call it right before ``allocate`` (another allocation in
        between may evict the blocks). With :attr:`tiers` attached, blocks of the
        prefix found in a tier are first promoted into free pool blocks (that changes
        the pool: cached blocks, evictions, tier contents; never a table or stat here).
        """
        n = len(token_ids)
        if not self.enable_prefix_caching or n <= self.block_size:
            return 0
        extra = encode_extra_keys(cache_salt, adapter_id)
        bs = self.block_size
        if self.tiers is not None:
            self.tiers.promote_prefix(self._root, extra, token_ids, bs)
        nb, hashes = longest_hit(self._groups, self._root, extra, token_ids, bs)
        # remember the hashes for the allocate that normally follows (keyed by content)
        self._peek_memo = (extra, list(token_ids[: len(hashes) * bs]), hashes)
        return nb * self.block_size

    def explain_miss(
        self,
        token_ids: Sequence[int],
        num_cached_tokens: int,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        remember_key: bool = True,
    ) -> CacheMissExplanation:
        """Why the prefix hit of ``token_ids`` is ``num_cached_tokens`` tokens
        (``kvpage.cache.explain``); call right after the lookup/allocation it explains.
        Changes no block or stat; with ``remember_key`` the request's cache key joins
        the bounded key record (for ``different_cache_key`` checks of later requests).
        """
        n = len(token_ids)
        if not self.enable_prefix_caching:
            return CacheMissExplanation("prefix_caching_disabled", n, 0)
        extra = encode_extra_keys(cache_salt, adapter_id)
        known: list[BlockHash] = []
        memo = self._peek_memo
        if memo is not None and memo[0] == extra:
            k = len(memo[2])
            if memo[1] == list(token_ids[: k * self.block_size]):
                known = memo[2]
        full = [gm.pool for gm in self._groups if gm.window is None]
        got = explain_first_miss(
            full,
            len(full) != self.num_groups,
            self.eviction_record,
            self._keys,
            self._root,
            extra,
            token_ids,
            self.block_size,
            num_cached_tokens,
            known,
        )
        if remember_key:
            self._keys.add(extra)
        return got

    def set_retention(
        self, request_id: str, retention: KVRetention | None, num_prompt_tokens: int
    ) -> None:
        """Give ``request_id`` a retention policy (``kvpage.cache.retention``), applied
        to its blocks when it frees them; None removes it.

        Raises:
            AllocationError: unknown request.
        """
        req = self._get(request_id)
        req.retention = None if retention is None else (retention, num_prompt_tokens)

    def attach_tiers(self, tiers: TieredCache) -> None:
        """Put KV tiers below the pool: prefix lookups then promote blocks found in a
        tier (``kvpage.cache.tiered``). ``tiers`` must be built over ``pools[0]``.
        The tiers' drops are recorded for miss explanations
        (:class:`TierEvictionRecorder`).

        Raises:
            SpecError: more than one KV group or a sliding window (tiers serve one
                full-attention group), prefix caching off, or another pool.
        """
        if not self._simple:
            raise SpecError(
                f"kv tiers: expected one full-attention KV group, got windows {self.windows}"
            )
        if not self.enable_prefix_caching:
            raise SpecError("kv tiers: expected enable_prefix_caching=True, got False")
        if tiers.pool is not self._pools[0]:
            raise SpecError("tiers: expected a TieredCache over this manager's pool")
        self.tiers = tiers
        if self.eviction_record.cap > 0:
            rec = TierEvictionRecorder(self.eviction_record, self.clock)
            for t in tiers.tiers:
                t.listeners.append(rec)

    def _retain(self, req: RequestBlocks, g: int, lo: int, hi: int) -> None:
        """Mark table entries ``lo .. hi-1`` of group ``g`` with the request's retention
        policy, before they are released (freed, or dropped by the sliding window)."""
        assert req.retention is not None
        policy, n_prompt = req.retention
        table = req.tables[g]
        pool = self._groups[g].pool
        for a, b, prio, ttl in policy.block_spans(n_prompt, self.block_size, len(table)):
            if a < hi and b > lo:
                pool.set_retention(table[max(a, lo) : min(b, hi)], prio, ttl)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash entry if no request holds blocks; False (no change) otherwise."""
        if any(p.num_used for p in self._pools):
            return False
        now = self.clock()
        rec = self.eviction_record
        for p in self._pools:
            for h in p.cached_hashes():
                rec.record_eviction(h, "device", "reset", now)
            p.reset_prefix_cache()
        return True


__all__ = ["TIER_DROP_POLICY", "ManagerPrefix", "TierEvictionRecorder"]
