"""TieredCache: demote evicted prefix blocks to host memory and disk, promote them back.

It attaches to the one :class:`~kvpage.cache.block_pool.BlockPool` of a single
full-attention KV group, or to every group's view of a unified pool (each group's
blocks keyed by :func:`tier_key`, promoted by the cross-group hit rule: see
:meth:`TieredCache.promote_prefix` and docs/architecture.md, "Tiers on the unified
pool"), as a :class:`~kvpage.cache.block_pool.PoolListener` (the seam
of docs/architecture.md) and to its :class:`~kvpage.cache.manager.KVCacheManager` as
``manager.tiers``:

* **Demotion.** ``on_evicted`` (the block's K/V still intact) only records the
  block as *pending*; :meth:`flush` copies every pending block out with one
  :meth:`BlockMover.read_blocks` call and puts them, in eviction order, into the host
  tier; blocks the host tier evicts go
  to the disk tier (or are dropped, reason ``"capacity"``, when there is none or it
  stopped; a block the stopped disk tier could not take is also reported by the disk
  tier as dropped, reason ``"write_error"``, though it never entered it). With no host tier (capacity 0) evicted blocks go straight to disk.
* **Promotion.** :meth:`promote_prefix`, called by
  ``KVCacheManager.get_num_cached_tokens`` before the pool lookup, walks the prompt's
  block hashes: blocks in the pool are held for the duration of the call (so the
  allocation below cannot evict them), blocks found in the host tier (taken out: host
  and pool are exclusive) or the disk tier (verified read; the file stays) are copied
  into fresh pool blocks in one :meth:`BlockMover.write_blocks` call and registered
  with ``cache_block``; the walk stops at the first block found nowhere. By default the
  whole tier hit is promoted even when the request cannot be admitted yet: the blocks
  wait at the LRU tail of the free queue (a prefetch), and running requests may evict
  them again before admission (churn: the next lookup promotes them again). With
  ``admissible_only`` it promotes only as many blocks as still let the request be
  admitted now (the free blocks must hold the free hit blocks plus its first chunk,
  ``admission_chunk_tokens``, else the rest of the prompt). Measured
  (docs/capacity-planning.md, section 10): on the KV-bound Mooncake simulation the
  prefetch default keeps more hits (8.09 vs 6.02 % of prompt tokens) and a shorter
  makespan despite the extra transfers; on the engine run both gave the same hits. The promoted
  blocks are then ordinary cached blocks, so the group managers never see a tier.
  :meth:`take_hit` tells the manager which tier each block of a taken hit came from
  (for ``num_cached_tokens_by_tier`` and ``TierStats.hits_tokens``); a promoted block
  remembers its tier until a hit takes it or the pool evicts it.

Copies are batched per lookup (promotion) and per step (demotion). The eviction
happens inside ``BlockPool.allocate`` during scheduling, before anything writes into the
reused block, so the evicted K/V stays readable until the next write. Every write into
pool blocks must therefore be preceded by :meth:`flush`: the engine flushes once per step
after ``schedule()`` and before the forward (which also runs the copy-on-write
``copy_blocks``), the scheduler flushes before a swap-in writes a readmitted request's
blocks, :meth:`promote_prefix` flushes before it looks the prompt up when one of the
prompt's blocks is pending (so a block evicted earlier in the same step is found) and
before it writes the promoted blocks when its own allocation evicted them (so a step
with promotions can take more than one copy-out), and :meth:`on_stored` flushes when the stored block or
hash is pending (so a reused block id is read before it is re-cached). Pending blocks are
in no tier (``where`` does not list them) until flushed; ``on_cleared`` forgets them.
The copy itself is synchronous (see ``kvpage.engine.kv_transfer`` for the device side).

Exactness: a block's payload is the full bit pattern of its K/V (and int8 token
scales) in every layer; a promoted block is bit-identical to the evicted one, so greedy
outputs with and without tiers are identical (tested in tests/engine/test_kv_tiers.py).
Listeners: ``host.listeners`` / ``disk.listeners`` (:class:`~kvpage.cache.tier_store.
TierListener`) see every demotion, promotion and drop with its reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvpage.cache.block_pool import BlockPool, GroupPool
from kvpage.cache.hashing import BlockHash, iter_block_hashes
from kvpage.cache.tier_store import DiskTier, HostTier, Payload, TierStats
from kvpage.errors import SpecError


class BlockMover(Protocol):
    """Copies whole blocks between the pool's per-layer caches and host payloads (the
    engine's ``kvpage.engine.kv_transfer.TorchBlockMover``; tests use a dict).

    Attributes:
        block_nbytes: bytes of one block's payload (all layers, K and V, scales).
    """

    block_nbytes: int

    def read_blocks(self, block_ids: Sequence[int]) -> list[Payload]:
        """Copies (never views) of the blocks' K/V, one payload per id, in order."""
        ...

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[Payload]) -> None:
        """Overwrite the blocks' K/V with the payloads (finished on return)."""
        ...


class TieredCache:
    """Host and disk tiers below one pool, or below every KV group of a unified pool
    (see the module docstring).

    Args:
        pool: the pool of the single full-attention KV group, or one pool view per KV
            group of a unified pool (``KVCacheManager.pools``, in group order).
        mover: copies block data; one per group when ``pool`` is a list (each over its
            group's layers; equal ``block_nbytes``).
        host: the host tier (None = none).
        disk: the disk tier (None = none).

    Attributes:
        host, disk: the tiers (read their ``stats``, ``used_bytes``, ``listeners``).
        pools, movers: per KV group (one entry for a single pool); ``pool`` / ``mover``
            are group 0's.
        first_needed: per group, the first block a query at a position sees
            (``GroupManager.first_needed_block``; bound by ``attach_tiers``; before
            that every group is treated as full attention).
        demote_failures: evicted blocks that no tier stored (dropped).
        promotions_deferred: lookups that found blocks in a tier but did not promote
            them because the request could not have been admitted then.
        admissible_only: promote only what the request can take if admitted now
            (default False: promote the whole tier hit; see the module docstring; one
            group only).
        admission_chunk_tokens: most tokens a first allocation takes after its hit (the
            scheduler's ``max_num_batched_tokens``; None = the whole prompt), for the
            admission estimate of ``admissible_only``.

    Raises:
        SpecError: neither tier given; pools and movers of different counts or block
            sizes; more than 255 groups.
    """

    def __init__(
        self,
        pool: BlockPool | GroupPool | Sequence[BlockPool | GroupPool],
        mover: BlockMover | Sequence[BlockMover],
        *,
        host: HostTier | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        if host is None and disk is None:
            raise SpecError("tiers: expected a host or a disk tier, got neither")
        pools = list(pool) if isinstance(pool, Sequence) else [pool]
        movers = list(mover) if isinstance(mover, Sequence) else [mover]
        if len(pools) != len(movers) or not pools or len(pools) > 255:
            raise SpecError(
                f"tiers: expected 1 .. 255 pools and one mover per pool, got "
                f"{len(pools)} pools and {len(movers)} movers"
            )
        if len({m.block_nbytes for m in movers}) != 1:
            raise SpecError(
                f"tiers: expected movers of equal block_nbytes (a unified pool's equal "
                f"pages), got {[m.block_nbytes for m in movers]}"
            )
        self.pools = pools
        self.movers = movers
        self.pool = pools[0]
        self.mover = movers[0]
        self.host = host
        self.disk = disk
        self.first_needed: list[Callable[[int], int]] = [_every_block for _ in pools]
        self.demote_failures = 0
        self.promotions_deferred = 0
        self.admission_chunk_tokens: int | None = None
        self._admissible_only = False
        #: tier key -> the tier that promoted it (until a hit takes it or it is evicted)
        self._promoted: dict[bytes, str] = {}
        #: evicted blocks not yet copied out, in eviction order: (group, block id, key)
        self._pending: list[tuple[int, int, bytes]] = []
        self._pending_ids: set[int] = set()
        self._pending_hashes: set[bytes] = set()
        #: flushes that copied at least one block
        self.flushes = 0
        for g, p in enumerate(pools):
            p.listeners.append(self if g == 0 else _GroupListener(self, g))

    @property
    def admissible_only(self) -> bool:
        """Promote only what the request can take if admitted now (one group only)."""
        return self._admissible_only

    @admissible_only.setter
    def admissible_only(self, on: bool) -> None:
        if on and len(self.pools) > 1:
            raise SpecError(
                "admissible_only: expected False with several KV groups (the admission "
                "estimate serves one group), got True"
            )
        self._admissible_only = on

    def detach(self) -> None:
        """Remove this cache from its pools' listeners (undoes the constructor's hook)."""
        for p in self.pools:
            for lst in list(p.listeners):
                if lst is self or (isinstance(lst, _GroupListener) and lst.tiers is self):
                    p.listeners.remove(lst)

    @property
    def pending(self) -> list[tuple[int, bytes]]:
        """``(block_id, tier key)`` of the evicted blocks not yet flushed (a copy)."""
        return [(bid, key) for _, bid, key in self._pending]

    @property
    def tiers(self) -> list[HostTier | DiskTier]:
        """The configured tiers, top down."""
        return [t for t in (self.host, self.disk) if t is not None]

    def stats(self) -> dict[str, TierStats]:
        """Tier name -> its counters (live objects; copy to keep a snapshot)."""
        return {t.name: t.stats for t in self.tiers}

    def where(self, block_hash: BlockHash, group: int = 0) -> list[str]:
        """Names of the places holding group ``group``'s block ``block_hash``:
        ``"device"`` (the pool), then ``"host"``, ``"disk"``."""
        key = tier_key(group, block_hash)
        out = ["device"] if self.pools[group].is_cached(block_hash) else []
        return out + [t.name for t in self.tiers if key in t]

    # ---- PoolListener ---------------------------------------------------------------
    def on_stored(self, block_id: int, block_hash: BlockHash) -> None:
        """Group 0's pool computed content the host tier still holds (see
        :meth:`stored_in_group`)."""
        self.stored_in_group(0, block_id, block_hash)

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """Group 0's pool evicted a cached block (see :meth:`evicted_in_group`)."""
        self.evicted_in_group(0, block_id, block_hash)

    def stored_in_group(self, group: int, block_id: int, block_hash: BlockHash) -> None:
        """Group ``group``'s pool cached ``block_hash``: drop the host copy (host and
        pool stay exclusive); a disk copy stays. A pending block of this id or key is
        flushed first (its K/V is still the evicted content)."""
        key = tier_key(group, block_hash)
        if block_id in self._pending_ids or key in self._pending_hashes:
            self.flush()
        if self.host is not None and key in self.host:
            self.host.discard(key, "stored_in_pool")

    def evicted_in_group(self, group: int, block_id: int, block_hash: BlockHash) -> None:
        """Record group ``group``'s evicted block for demotion at the next :meth:`flush`
        (module docstring)."""
        key = tier_key(group, block_hash)
        self._promoted.pop(key, None)
        self._pending.append((group, block_id, key))
        self._pending_ids.add(block_id)
        self._pending_hashes.add(key)

    def flush(self) -> int:
        """Demote every pending block: one ``read_blocks`` call per group with pending
        blocks (one call in all for a single group), then, in eviction order, into the
        host tier (its LRU victims to disk) or, with no host tier, to disk, each under
        its :func:`tier_key`. Must run before anything writes into pool blocks (module
        docstring). The copy time is added to the host tier's ``transfer_s``.

        Returns:
            The number of blocks copied out (0: nothing pending, no mover call).

        Raises:
            Exception: whatever a mover raised; the pending blocks are then dropped
                (counted in ``demote_failures``), never demoted with unknown content.
        """
        pend = self._pending
        if not pend:
            return 0
        self._pending = []
        self._pending_ids.clear()
        self._pending_hashes.clear()
        t0 = time.perf_counter()
        by_group: dict[int, list[int]] = {}
        for i, (g, _, _) in enumerate(pend):
            by_group.setdefault(g, []).append(i)
        payloads: list[Payload] = [None] * len(pend)
        try:
            for g, idx in by_group.items():
                got = self.movers[g].read_blocks([pend[i][1] for i in idx])
                for i, p in zip(idx, got):
                    payloads[i] = p
        except BaseException:
            self.demote_failures += len(pend)
            raise
        dt = time.perf_counter() - t0
        self.flushes += 1
        host = self.host
        if host is not None:
            host.stats.transfer_s += dt
        for (_, _, key), payload in zip(pend, payloads):
            if host is not None:
                for h, p in host.put(key, payload):
                    self._to_disk(h, p, "host")
            else:
                self._to_disk(key, payload, None)
        return len(pend)

    def _to_disk(self, h: BlockHash, payload: Payload, source: str | None) -> None:
        """Demote one block to disk; ``source`` "host" when the host tier evicted it
        (the host then reports it dropped: ``capacity``, or ``write_error`` when the
        disk tier stopped after a failed write and the block is lost). A block that came
        straight from the pool and is lost that way is reported by the disk tier
        (``write_error``), so a later miss names the failed write."""
        disk = self.disk
        stored = disk is not None and (h in disk or disk.put(h, payload))
        if not stored:
            self.demote_failures += 1
        if source == "host" and self.host is not None:
            lost_to_error = not stored and disk is not None and not disk.writable
            self.host._emit_dropped(h, "write_error" if lost_to_error else "capacity")
        elif not stored and disk is not None and not disk.writable:
            # straight from the pool (no host tier) and lost to the failed disk write
            disk._emit_dropped(h, "write_error")

    def on_cleared(self) -> None:
        """``reset_prefix_cache`` forgets every tier and the pending blocks too."""
        self._promoted.clear()
        self._pending.clear()
        self._pending_ids.clear()
        self._pending_hashes.clear()
        for t in self.tiers:
            t.clear()

    # ---- promotion ------------------------------------------------------------------
    def promote_prefix(
        self,
        root: BlockHash,
        extra: bytes,
        token_ids: Sequence[int],
        block_size: int,
        max_blocks: int | None = None,
    ) -> int:
        """Copy the prompt's leading blocks found in a tier into the pool (see the module
        docstring). Considers at most ``(len(token_ids) - 1) // block_size`` blocks (a
        hit leaves one token to compute) and at most ``max_blocks`` (a hybrid's hit ends
        at its deepest state snapshot: blocks past it would be promoted for nothing).
        Flushes first when one of the prompt's blocks is pending (evicted earlier in
        this step), so it is found in its tier. Returns the number of blocks promoted
        (over every group).

        With several KV groups (a unified pool) a block counts as available to group
        ``g`` when its pool or a tier holds key ``tier_key(g, hash)``; the longest
        prefix every group can serve by the cross-group rule (full groups: every block;
        a sliding group: ``first_needed(end) .. end-1``) is found, cut to what the free
        blocks can take, and each group's needed tier blocks are copied in (one
        ``write_blocks`` call per group) before any is released, so no group's
        promotion evicts another's."""
        cap = (len(token_ids) - 1) // block_size
        if max_blocks is not None:
            cap = min(cap, max_blocks)
        if len(self.pools) > 1:
            return self._promote_groups(root, extra, token_ids, block_size, cap)
        pool = self.pool
        if self._pending_hashes and not self._pending_hashes.isdisjoint(
            iter_block_hashes(root, extra, token_ids, block_size, 0, cap)
        ):
            self.flush()
        held: list[int] = []
        pool_ids: list[int] = []  # pool block ids of the prefix (held or in use)
        wanted: list[tuple[BlockHash, str]] = []
        for h in iter_block_hashes(root, extra, token_ids, block_size, 0, cap):
            bid = pool.cached_block_id(h)
            if bid is not None:
                if wanted:
                    break  # a pool block after a gap: the hit ends at the gap anyway
                pool_ids.append(bid)
                if pool.ref_count(bid) == 0:
                    held.append(bid)
                continue
            if self.host is not None and h in self.host:
                wanted.append((h, "host"))
            elif self.disk is not None and h in self.disk:
                wanted.append((h, "disk"))
            else:
                break
        if not wanted:
            return 0
        # admissible_only: promote only as many blocks as still let the request be
        # admitted now, else they may be evicted again before the next lookup (churn)
        if self.admissible_only:
            k = self._admissible(len(token_ids), len(pool_ids), len(held), len(wanted), block_size)
            if k == 0:
                self.promotions_deferred += 1
                return 0
            wanted = wanted[:k]
        pool.touch_ids(held)  # protect the pool part of the hit from the allocation
        try:
            wanted = wanted[: pool.num_free]
            payloads: list[Payload] = []
            got: list[tuple[BlockHash, str]] = []
            for h, tier in wanted:  # take before allocating: the allocation demotes
                p = self.host.take(h) if tier == "host" and self.host else None
                if p is None and self.disk is not None:
                    p = self.disk.get(h)  # (times its own read)
                    tier = "disk"
                if p is None:
                    break  # corrupt or gone: the hit ends here (counted by the tier)
                payloads.append(p)
                got.append((h, tier))
            if not got:
                return 0
            ids = pool.allocate_ids(len(got))
            if not self._pending_ids.isdisjoint(ids):
                self.flush()  # the allocation evicted blocks it reuses: copy them out first
            t0 = time.perf_counter()
            self.mover.write_blocks(ids, payloads)
            dt = time.perf_counter() - t0
            for bid, (h, tier) in zip(ids, got):
                pool.cache_block(bid, h)
                self._promoted[h] = tier
                t = self.host if tier == "host" else self.disk
                assert t is not None
                t.stats.transfer_s += dt / len(got)
            pool.release(reversed(ids))
            return len(got)
        finally:
            pool.release(reversed(held))

    def _places(self, hashes: Sequence[BlockHash]) -> list[list[str | None]]:
        """Per group and block of ``hashes``: "device", "host", "disk", "pending"
        (evicted this step, on its way to a tier) or None (found nowhere)."""
        place: list[list[str | None]] = []
        for g, pool in enumerate(self.pools):
            row: list[str | None] = []
            for h in hashes:
                key = tier_key(g, h)
                if pool.is_cached(h):
                    row.append("device")
                elif self.host is not None and key in self.host:
                    row.append("host")
                elif self.disk is not None and key in self.disk:
                    row.append("disk")
                elif key in self._pending_hashes:
                    row.append("pending")
                else:
                    row.append(None)
            place.append(row)
        return place

    def prefix_blocks(
        self, root: BlockHash, extra: bytes, token_ids: Sequence[int], block_size: int
    ) -> int:
        """The longest prefix, in blocks (at most ``(len(token_ids) - 1) // block_size``),
        that the pool and the tiers together hold by the hit rule of
        :meth:`promote_prefix` (every group its needed blocks). Changes nothing: a miss
        explanation's KV position where a hybrid's promotion stopped at its deepest
        snapshot."""
        cap = (len(token_ids) - 1) // block_size
        hashes = list(iter_block_hashes(root, extra, token_ids, block_size, 0, cap))
        place = self._places(hashes)
        groups = range(len(self.pools))
        for nb in range(cap, 0, -1):
            need = self._needed(nb, block_size)
            if all(place[g][i] is not None for g in groups for i in need[g]):
                return nb
        return 0

    def _needed(self, nb: int, bs: int) -> list[range]:
        """Per group, the block indices a hit of ``nb`` blocks needs."""
        return [range(min(f(nb * bs), nb), nb) for f in self.first_needed]

    def _promote_groups(
        self, root: BlockHash, extra: bytes, token_ids: Sequence[int], bs: int, cap: int
    ) -> int:
        """:meth:`promote_prefix` over several KV groups, the first ``cap`` blocks."""
        hashes = list(iter_block_hashes(root, extra, token_ids, bs, 0, cap))
        groups = range(len(self.pools))
        if self._pending_hashes and any(
            tier_key(g, h) in self._pending_hashes for g in groups for h in hashes
        ):
            self.flush()
        place = self._places(hashes)
        free = self.pools[0].num_free
        for nb in range(cap, 0, -1):
            need = self._needed(nb, bs)
            if any(place[g][i] is None for g in groups for i in need[g]):
                continue
            held = {
                self.pools[g].cached_block_id(hashes[i])
                for g in groups
                for i in need[g]
                if place[g][i] == "device"
            }
            held_free = [b for b in held if b is not None and self.pools[0].ref_count(b) == 0]
            n_tier = sum(place[g][i] != "device" for g in groups for i in need[g])
            if n_tier == 0:
                return 0  # the pool serves the longest hit alone
            if n_tier + len(held_free) <= free:
                return self._copy_in(hashes, need, place, held_free)
        return 0

    def _copy_in(
        self,
        hashes: list[BlockHash],
        need: list[range],
        place: list[list[str | None]],
        held: list[int],
    ) -> int:
        """Copy each group's needed tier blocks into fresh blocks of its pool (the held
        pool blocks protected meanwhile); returns the number promoted."""
        pool0 = self.pools[0]
        pool0.touch_ids(held)
        allocated: list[list[int]] = []
        try:
            got: list[list[tuple[bytes, str, Payload]]] = []
            for g in range(len(self.pools)):
                row = []
                for i in need[g]:
                    tier = place[g][i]
                    if tier == "device":
                        continue
                    key = tier_key(g, hashes[i])
                    p = self.host.take(key) if tier == "host" and self.host else None
                    if p is None and self.disk is not None:
                        p, tier = self.disk.get(key), "disk"
                    if p is not None:  # else corrupt or gone (counted by the tier)
                        assert tier is not None
                        row.append((hashes[i], tier, p))
                got.append(row)
            for g, row in enumerate(got):  # allocate all before releasing any
                allocated.append(self.pools[g].allocate_ids(len(row)) if row else [])
            if not self._pending_ids.isdisjoint(i for ids in allocated for i in ids):
                self.flush()  # the allocation evicted blocks it reuses: copy them out
            n = 0
            for g, (row, ids) in enumerate(zip(got, allocated)):
                if not row:
                    continue
                t0 = time.perf_counter()
                self.movers[g].write_blocks(ids, [p for _, _, p in row])
                dt = time.perf_counter() - t0
                for bid, (h, tier, _) in zip(ids, row):
                    self.pools[g].cache_block(bid, h)
                    self._promoted[tier_key(g, h)] = tier
                    t = self.host if tier == "host" else self.disk
                    assert t is not None
                    t.stats.transfer_s += dt / len(row)
                n += len(row)
            return n
        finally:
            for g, ids in reversed(list(enumerate(allocated))):
                self.pools[g].release(reversed(ids))
            pool0.release(reversed(held))

    def _admissible(self, n: int, in_pool: int, held: int, found: int, bs: int) -> int:
        """Most of the ``found`` tier blocks (after ``in_pool`` pool blocks, ``held`` of
        them free) that a first allocation of an ``n``-token prompt can take now: the
        free blocks must hold the free hit blocks plus the first chunk after the hit
        (``admission_chunk_tokens``, else the rest of the prompt). 0 when none."""
        chunk = self.admission_chunk_tokens
        free = self.pool.num_free
        for k in range(found, 0, -1):
            first = n - (in_pool + k) * bs
            if chunk is not None:
                first = min(first, chunk)
            if held + k + -(-first // bs) <= free:
                return k
        return 0

    def take_hit(self, hashes: Sequence[BlockHash], block_size: int) -> dict[str, int]:
        """Account a prefix hit a request takes: per place (``"device"``, ``"host"``,
        ``"disk"``), the hit's tokens. A block counts for the tier that promoted it
        the first time a hit takes it (then for ``"device"``); with several groups a
        hit block counts for the slowest place any group that takes it (full groups:
        every block; a sliding group: its window's) promoted it from (disk, then host,
        then device). Adds to ``TierStats.hits_tokens``."""
        p = self._promoted
        out = {"device": 0}
        nb = len(hashes)
        need = self._needed(nb, block_size)
        rank = {"device": 0, "host": 1, "disk": 2}
        for i, h in enumerate(hashes):
            tier = "device"
            for g in range(len(self.pools)):
                if i in need[g]:
                    src = p.pop(tier_key(g, h), "device")
                    tier = src if rank[src] > rank[tier] else tier
            out[tier] = out.get(tier, 0) + block_size
        for t in self.tiers:
            t.stats.hits_tokens += out.get(t.name, 0)
        return out


def tier_key(group: int, block_hash: BlockHash) -> bytes:
    """The tiers' key of KV group ``group``'s block ``block_hash``: the hash itself for
    group 0 (so a one-group layout keys, and its disk files are named, exactly as
    before), the byte ``group`` then the hash for any other group. Block hashes have
    one fixed length, so the two forms never collide, and the key depends only on
    the group index and the content (it survives a restart of the disk tier; the
    disk tier's fingerprint covers the group layout).

    Raises:
        ValueError: ``group`` outside 0 .. 255.
    """
    if group == 0:
        return block_hash
    return bytes([group]) + block_hash


def _every_block(position: int) -> int:
    """``first_needed`` of a full-attention group: block 0."""
    return 0


class _GroupListener:
    """The :class:`~kvpage.cache.block_pool.PoolListener` of KV group ``group`` (> 0)
    of a unified pool: forwards to its :class:`TieredCache` with the group."""

    def __init__(self, tiers: TieredCache, group: int) -> None:
        self.tiers = tiers
        self.group = group

    def on_stored(self, block_id: int, block_hash: BlockHash) -> None:
        self.tiers.stored_in_group(self.group, block_id, block_hash)

    def on_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        self.tiers.evicted_in_group(self.group, block_id, block_hash)

    def on_cleared(self) -> None:
        self.tiers.on_cleared()


__all__ = ["BlockMover", "TieredCache", "tier_key"]
