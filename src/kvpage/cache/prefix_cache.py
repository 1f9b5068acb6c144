"""The prefix cache of a :class:`~kvpage.cache.manager.KVCacheManager`
(:class:`PrefixCache`): the hash chain's root, prefix lookup over the KV groups, the KV
tiers below the pool, the eviction and cache-key records behind miss explanations, and
resetting; and :class:`TierEvictionRecorder`, which records the KV tiers' drops for miss
explanations.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvpage.cache.block_pool import BlockPool, GroupPool
from kvpage.cache.explain import (
    CacheMissExplanation,
    EvictionRecord,
    KeyRecord,
    PoolEvictionRecorder,
    explain_first_miss,
)
from kvpage.cache.group_managers import GroupManager
from kvpage.cache.hashing import BlockHash, iter_block_hashes, root_hash
from kvpage.cache.prefix import longest_hit
from kvpage.cache.tier_store import is_state_key
from kvpage.errors import AllocationError, SpecError

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
        if is_state_key(block_hash):
            return  # a recurrent-state snapshot file (kvpage.cache.state_pool), not a block
        if reason == "stored_in_pool":
            self.record.forget(block_hash)
            return
        policy = TIER_DROP_POLICY.get(reason, reason)
        self.record.record_eviction(block_hash, tier, policy, self._clock())


class PrefixCache:
    """The prefix-cache side of a :class:`~kvpage.cache.manager.KVCacheManager`: it
    finds cached prefixes in the groups' pools (and promotes them from the KV tiers),
    explains misses, and owns the records that explain them. The manager owns the
    requests' tables and calls it on a request's first allocation.

    Args:
        groups: the manager's group managers (read: their pools' hash maps).
        block_size: tokens per block.
        enabled: prefix caching on (off: every lookup is 0 and nothing is recorded).
        hash_seed: seed of the block-hash chain (``kvpage.cache.hashing.root_hash``).
        eviction_record_cap: evicted hashes remembered for miss explanations (0 = none).
        clock: seconds for eviction times.

    Attributes:
        root: the root of the hash chain.
        eviction_record: evictions of every tier (the pools record theirs through a
            ``PoolEvictionRecorder``; lower tiers through :class:`TierEvictionRecorder`).
        tiers: the host/disk tiers below the pool (:meth:`attach_tiers`), None = none.
    """

    def __init__(
        self,
        groups: list[GroupManager],
        block_size: int,
        *,
        enabled: bool,
        hash_seed: int,
        eviction_record_cap: int,
        clock: Callable[[], float],
    ) -> None:
        self._groups = groups
        self.block_size = block_size
        self.enabled = enabled
        self.root = root_hash(hash_seed)
        self.clock = clock
        self.eviction_record = EvictionRecord(eviction_record_cap)
        self._keys = KeyRecord()
        self.tiers: TieredCache | None = None
        # hashes of the last lookup: (extra keys, tokens, hashes)
        self._memo: tuple[bytes, list[int], list[BlockHash]] | None = None
        if enabled and eviction_record_cap > 0:
            for gm in groups:
                p = gm.pool
                p.listeners.append(PoolEvictionRecorder(self.eviction_record, p.priority_of, clock))

    @property
    def prefix_pools(self) -> list[BlockPool | GroupPool]:
        """The pools whose hash maps decide a hit: those of the full-attention groups
        (all pools when every group is sliding-window)."""
        full = [gm.pool for gm in self._groups if gm.window is None]
        return full or [gm.pool for gm in self._groups]

    def lookup(
        self, token_ids: Sequence[int], extra: bytes, promote_max_blocks: int | None = None
    ) -> int:
        """The prefix hit of a new request, in tokens (see
        ``KVCacheManager.get_num_cached_tokens``); remembers the hashes it computed.
        With tiers, at most ``promote_max_blocks`` leading blocks are promoted
        (``TieredCache.promote_prefix``)."""
        bs = self.block_size
        if not self.enabled or len(token_ids) <= bs:
            return 0
        if self.tiers is not None:
            self.tiers.promote_prefix(self.root, extra, token_ids, bs, promote_max_blocks)
        nb, hashes = longest_hit(self._groups, self.root, extra, token_ids, bs)
        # remember the hashes for the allocate that normally follows (keyed by content)
        self._memo = (extra, list(token_ids[: len(hashes) * bs]), hashes)
        return nb * bs

    def block_hashes(
        self, extra: bytes, token_ids: Sequence[int], num_blocks: int
    ) -> list[BlockHash]:
        """The hashes of the first ``num_blocks`` blocks (the last lookup's when it hashed
        the same tokens and keys)."""
        bs = self.block_size
        memo = self._memo
        if (
            memo is not None
            and memo[0] == extra
            and len(memo[2]) >= num_blocks
            and memo[1][: num_blocks * bs] == list(token_ids[: num_blocks * bs])
        ):
            return memo[2][:num_blocks]
        return list(iter_block_hashes(self.root, extra, token_ids, bs, 0, num_blocks))

    def hit_tables(self, hashes: list[BlockHash], num_cached_tokens: int) -> list[list[int]]:
        """Per group, the table prefix a hit takes (see ``GroupManager.hit_block_ids``).

        Raises:
            AllocationError: a needed block is not cached (any more).
        """
        hit: list[list[int]] = []
        for g, gm in enumerate(self._groups):
            ids = gm.hit_block_ids(hashes, num_cached_tokens)
            if ids is None:
                raise AllocationError(
                    f"num_cached_tokens: expected <= the tokens cached now, got "
                    f"{num_cached_tokens} (a block of group {g} is not cached; "
                    "call get_num_cached_tokens right before allocate)"
                )
            hit.append(ids)
        return hit

    def hit_by_tier(self, hashes: list[BlockHash], num_cached_tokens: int) -> dict[str, int]:
        """The tokens of a taken hit by the tier they came from (``device`` only without
        tiers; with tiers, ``TieredCache.take_hit``)."""
        if self.tiers is not None and num_cached_tokens:
            return self.tiers.take_hit(hashes, self.block_size)
        return {"device": num_cached_tokens}

    def explain_miss(
        self,
        token_ids: Sequence[int],
        num_cached_tokens: int,
        extra: bytes,
        remember_key: bool,
    ) -> CacheMissExplanation:
        """Why the prefix hit of ``token_ids`` is ``num_cached_tokens`` tokens (see
        ``KVCacheManager.explain_miss``)."""
        if not self.enabled:
            return CacheMissExplanation("prefix_caching_disabled", len(token_ids), 0)
        known: list[BlockHash] = []
        memo = self._memo
        if memo is not None and memo[0] == extra:
            k = len(memo[2])
            if memo[1] == list(token_ids[: k * self.block_size]):
                known = memo[2]
        full = [gm.pool for gm in self._groups if gm.window is None]
        got = explain_first_miss(
            full,
            len(full) != len(self._groups),
            self.eviction_record,
            self._keys,
            self.root,
            extra,
            token_ids,
            self.block_size,
            num_cached_tokens,
            known,
        )
        if remember_key:
            self._keys.add(extra)
        return got

    def attach_tiers(self, tiers: TieredCache) -> None:
        """Put KV tiers below the pool (see ``KVCacheManager.attach_tiers``) and bind
        each group's ``first_needed_block`` to ``tiers.first_needed``.

        Raises:
            SpecError: several KV groups outside a unified pool, or a lone
                sliding-window group; prefix caching off; tiers over other pools.
        """
        windows = [gm.window for gm in self._groups]
        pools = [gm.pool for gm in self._groups]
        unified = len(pools) > 1 and all(
            isinstance(p, GroupPool) and p.shared is getattr(pools[0], "shared", None)
            for p in pools
        )
        if windows != [None] and not unified:
            raise SpecError(
                f"kv tiers: expected one full-attention KV group or the KV groups of a "
                f"unified pool (kv_pool='unified'), got windows {windows} on separate pools"
            )
        if not self.enabled:
            raise SpecError("kv tiers: expected enable_prefix_caching=True, got False")
        if len(tiers.pools) != len(pools) or any(a is not b for a, b in zip(tiers.pools, pools)):
            raise SpecError("tiers: expected a TieredCache over this manager's pools")
        tiers.first_needed = [gm.first_needed_block for gm in self._groups]
        self.tiers = tiers
        if self.eviction_record.cap > 0:
            rec = TierEvictionRecorder(self.eviction_record, self.clock)
            for t in tiers.tiers:
                t.listeners.append(rec)

    def reset(self) -> bool:
        """Drop every hash entry if no request holds blocks (each recorded as a
        ``reset`` eviction); False (no change) otherwise."""
        pools = [gm.pool for gm in self._groups]
        if any(p.num_used for p in pools):
            return False
        now = self.clock()
        rec = self.eviction_record
        for p in pools:
            for h in p.cached_hashes():
                rec.record_eviction(h, "device", "reset", now)
        done: list[BlockPool] = []  # a shared pool is reset once (listeners told once)
        for p in pools:
            base = p.shared if isinstance(p, GroupPool) else p
            if all(base is not d for d in done):
                base.reset_prefix_cache()
                done.append(base)
        return True


__all__ = ["TIER_DROP_POLICY", "PrefixCache", "TierEvictionRecorder"]
