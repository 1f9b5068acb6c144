"""KVCacheManager: the one allocator the scheduler sees.

Per request and per KV group (``CacheSpec.kv_groups``) the manager keeps a block
table: ``table[i]`` is the physical block holding positions ``i*block_size ..
(i+1)*block_size - 1``. Each group has its own :class:`BlockPool`; all groups of a
request cover the same positions, so hashes (which depend on tokens only) are shared.

Block lifecycle (see docs/architecture.md): *allocate* (room for new tokens, a prefix
hit revives cached blocks) -> the step *writes* K/V -> *commit* registers blocks that
are full and written as prefix-cache entries (C04) -> *free* returns blocks to the free
queue, still cached -> a later allocation *evicts* them (hash entry removed in the same
operation). *Fork* shares blocks (ref counts); a write into a shared partial block is
*copied* first (CoW, C06). In a sliding-window group, blocks wholly outside the window
of the next query are released (table entry -> null block 0, C10).

Layers (each calls only the public methods of the one below): this manager (requests,
hashes, stats, all-or-nothing across groups) -> one
:class:`~kvpage.cache.group_managers.GroupManager` per KV group (full attention or
sliding window: window release, CoW, growth of one table) -> that group's
:class:`~kvpage.cache.block_pool.BlockPool` (ref counts, free queue, hash map).

The manager owns the requests' block tables, the group managers and the counters; it
holds a :class:`~kvpage.cache.prefix_cache.PrefixCache` (hash root, prefix lookup, KV
tiers, eviction and cache-key records for miss explanations) and calls it on a
request's first allocation.

Pools (``CacheSpec.kv_pool``, docs/architecture.md "One pool for every kind of
layer"): ``unified`` (with more than one group): one :class:`BlockPool` of
``spec.num_blocks`` that every group allocates from and frees into, each group through
its :class:`~kvpage.cache.block_pool.GroupPool` view (own hash map); the fit checks
sum every group's demand, window releases of all groups run before any group's new
blocks are taken, and eviction follows the one free queue (global LRU, tail-first,
retention levels). ``per_group`` (and every one-group model): one pool per group.

Recurrent state (hybrid models, ``CacheSpec.state_layers``): the manager composes a
:class:`~kvpage.cache.state_pool.StatePool` (:attr:`KVCacheManager.state`): one live
state slot per request (taken with its first allocation, returned by :meth:`free`,
copied by :meth:`fork`) and snapshots keyed by the block hash ending at their boundary.
A prefix hit is then the longest prefix whose KV blocks are cached in every attention
group **and** that ends at a snapshot (searched right to left over the KV hit's
boundaries); the boundaries to snapshot come from the pool's
:class:`~kvpage.cache.snapshot_policy.SnapshotPolicy` (:meth:`state_chunk_end` tells the
scheduler where a prefill chunk must end; :meth:`commit` takes the snapshots).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvpage.cache.allocation import Allocation, CacheStats, RequestBlocks
from kvpage.cache.block_pool import NULL_BLOCK_ID, BlockPool, GroupPool
from kvpage.cache.explain import (
    DEFAULT_EVICTION_RECORD_CAP,
    CacheMissExplanation,
    EvictionRecord,
)
from kvpage.cache.free_queue import PRIORITY_DEFAULT
from kvpage.cache.group_managers import GroupManager, PendingGrowth, make_group_manager
from kvpage.cache.hashing import BlockHash, chain_hash, encode_extra_keys, iter_block_hashes
from kvpage.cache.integrity import check_manager_integrity
from kvpage.cache.prefix_cache import PrefixCache
from kvpage.cache.retention import KVRetention
from kvpage.cache.snapshot_policy import SnapshotPoint
from kvpage.cache.state_pool import StatePool
from kvpage.errors import AllocationError, SpecError
from kvpage.specs import CacheSpec

if TYPE_CHECKING:
    from kvpage.cache.tiered import TieredCache


#: request ids remembered so that a readmission after preemption does not count its
#: prompt's boundaries as passed again (the snapshot policy's pass counts)
_OBSERVED_CAP = 65536


class KVCacheManager:
    """Paged KV-cache bookkeeping for one model: prefix caching, CoW, sliding windows.

    Args:
        spec: the cache layout; ``spec.num_blocks`` blocks (>= 2, block 0 is the null
            block) in the one pool (``kv_pool="unified"``) or in each group's pool
            (``"per_group"``).
        enable_prefix_caching: look up and register block hashes.
        hash_seed: seed of the block-hash chain (see ``kvpage.cache.hashing``).
        max_retained_blocks: per pool, most free blocks a retention policy may hold at
            a raised priority (None = ``BlockPool``'s default, half the pool).
        eviction_record_cap: evicted hashes remembered for miss explanations
            (``kvpage.cache.explain``; 0 = none).
        clock: seconds for retention deadlines and eviction times
            (``time.monotonic``).
        state_pool: the recurrent state slots (``kvpage.cache.state_pool``), required
            exactly when ``spec.state_layers`` is not empty (hybrid models).
        max_alloc_tokens: the most new tokens one ``allocate`` call asks for (the
            scheduler's token budget, ``max_num_batched_tokens``; None = no limit).
            With a unified pool it bounds what a sliding group holds, so
            :attr:`max_request_tokens` counts only its window (+ one call's tokens);
            only there is a larger call refused (a swap-in's swapped tokens do not
            count: :meth:`allocate_swapped` gives a sliding group only their window).

    Attributes:
        block_size: tokens per block.
        num_groups: KV groups (one block table per group per request).
        windows: per group, the sliding window in tokens (None = full attention).
        max_request_tokens: tokens one request can reach alone: per-group pools
            ``(num_blocks - 1) * block_size``; a unified pool without
            ``max_alloc_tokens`` ``(num_blocks - 1) // G * block_size`` (``G`` groups,
            each holding every block if it is allocated in one call); with
            ``max_alloc_tokens = c`` the largest ``T`` whose peak fits,
            ``sum_full ceil(T / bs) + sum_sliding min(ceil(T / bs), ceil((W + c - 1) /
            bs) + 1) <= num_blocks - 1`` (after a call for ``[s, s + n)``, ``n <= c``, a
            sliding group holds blocks ``(s - W + 1) // bs .. ceil((s + n) / bs) - 1``);
            ``2**40`` when every group slides and their windows fit.
        unified: whether the groups share one pool (``kv_pool="unified"`` and more
            than one group).
        prefix_cache: the :class:`~kvpage.cache.prefix_cache.PrefixCache` (lookup,
            tiers, miss-explanation records).

    Raises:
        SpecError: ``spec.num_blocks < 2``; no attention layer; a ``state_pool`` without
            state layers, state layers without one, or one of another block size.
    """

    def __init__(
        self,
        spec: CacheSpec,
        *,
        enable_prefix_caching: bool = True,
        hash_seed: int = 0,
        max_retained_blocks: int | None = None,
        eviction_record_cap: int = DEFAULT_EVICTION_RECORD_CAP,
        clock: Callable[[], float] = time.monotonic,
        max_alloc_tokens: int | None = None,
        state_pool: StatePool | None = None,
    ) -> None:
        if not spec.layers and not spec.state_layers:
            raise SpecError("spec.layers: expected >= 1 attention or state layer, got 0")
        if bool(spec.state_layers) != (state_pool is not None):
            raise SpecError(
                f"state_pool: expected a StatePool exactly when the spec has state layers "
                f"(it has {len(spec.state_layers)}), got "
                f"{'none' if state_pool is None else 'one'}"
            )
        if state_pool is not None and state_pool.policy.block_size != spec.block_size:
            raise SpecError(
                f"state_pool.policy.block_size: expected {spec.block_size} (the spec's), "
                f"got {state_pool.policy.block_size}"
            )
        #: the recurrent state slots (hybrid models), None without state layers
        self.state = state_pool
        #: per request, the snapshot boundaries still to take (prefill)
        self._points: dict[str, list[SnapshotPoint]] = {}
        #: the last hybrid lookup: (extra, tokens hashed, KV hit, state hit) in tokens
        self._state_lookup: tuple[bytes, list[int], int, int] | None = None
        #: requests whose prompt passes the snapshot policy counted (bounded)
        self._observed: OrderedDict[str, None] = OrderedDict()
        #: the last prompt fully hashed for the snapshot policy: (extra, tokens, hashes)
        self._hash_memo: tuple[bytes, list[int], list[BlockHash]] | None = None
        if max_alloc_tokens is not None and max_alloc_tokens < 1:
            raise SpecError(f"max_alloc_tokens: expected None or >= 1, got {max_alloc_tokens}")
        self.max_alloc_tokens = max_alloc_tokens
        if spec.num_blocks < 2:
            raise SpecError(
                f"spec.num_blocks: expected >= 2 (block 0 is the null block), got {spec.num_blocks}"
            )
        self.spec = spec
        self.block_size = spec.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_seed = hash_seed
        self.windows: list[int | None] = [g.sliding_window for g in spec.kv_groups]
        self.num_groups = len(self.windows)
        self.unified = spec.kv_pool == "unified" and self.num_groups > 1

        def new_pool() -> BlockPool:
            return BlockPool(
                spec.num_blocks,
                enable_caching=enable_prefix_caching,
                max_retained_blocks=max_retained_blocks,
                clock=clock,
            )

        if self.unified:
            shared = new_pool()
            self._shared: BlockPool | None = shared
            views: list[BlockPool | GroupPool] = [shared.add_group() for _ in self.windows]
        else:
            self._shared = None
            views = [new_pool() for _ in self.windows]
        self._groups: list[GroupManager] = [
            make_group_manager(v, spec.block_size, w) for v, w in zip(views, self.windows)
        ]
        self._pools = views
        self.clock = clock
        self.prefix_cache = PrefixCache(
            self._groups,
            spec.block_size,
            enabled=enable_prefix_caching,
            hash_seed=hash_seed,
            eviction_record_cap=eviction_record_cap,
            clock=clock,
        )
        #: one full-attention group: ``allocate`` tries ``try_append`` first (the
        #: general path's result, tested; ~10 % of schedule + update, docs/benchmarks.md)
        self._simple = self.windows == [None]
        self._reqs: dict[str, RequestBlocks] = {}
        self._stats = CacheStats()
        self.max_request_tokens = self._max_request_tokens()

    def _max_request_tokens(self) -> int:
        """:attr:`max_request_tokens` (class docstring)."""
        bs = self.block_size
        usable = self.spec.num_blocks - 1
        if not self._groups:  # recurrent layers only: no KV block bounds a sequence
            return 1 << 40
        if not self.unified:
            return usable * bs
        c = self.max_alloc_tokens
        if c is None:
            return usable // self.num_groups * bs
        nfull = sum(1 for w in self.windows if w is None)
        caps = [-(-(w + c - 1) // bs) + 1 for w in self.windows if w is not None]

        def need(nb: int) -> int:  # peak blocks of a request of nb blocks' tokens
            return nfull * nb + sum(min(nb, k) for k in caps)

        if nfull == 0 and need(max(caps)) <= usable:
            return 1 << 40  # windows only: any length (the model's context limits it)
        lo, hi = 0, usable
        while lo < hi:  # the most blocks nb with need(nb) <= usable
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if need(mid) <= usable else (lo, mid - 1)
        return lo * bs

    @property
    def eviction_record(self) -> EvictionRecord:
        """Evictions of every tier (the prefix cache's record; the device pool records
        its own, lower tiers call ``eviction_record.record_eviction``)."""
        return self.prefix_cache.eviction_record

    @property
    def tiers(self) -> TieredCache | None:
        """The host/disk tiers below the pool (:meth:`attach_tiers`), None = none."""
        return self.prefix_cache.tiers

    # ---- allocation ---------------------------------------------------------------------
    def allocate(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        *,
        num_cached_tokens: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> Allocation | None:
        """Make room for a request's next tokens.

        First call for ``request_id``: takes the prefix hit ``num_cached_tokens`` (from
        :meth:`get_num_cached_tokens`, counted in the prefix stats), then room for
        positions ``[num_cached_tokens, num_cached_tokens + num_new_tokens)``. Later
        calls: room for ``num_new_tokens`` more positions after those allocated, after
        releasing sliding-window blocks no longer needed and copying a shared partial
        last block (CoW). ``cache_salt``/``adapter_id`` are read on the first call only.

        Args:
            request_id: the request.
            token_ids: all tokens of the request known so far (for hashing).
            num_new_tokens: tokens to make room for (>= 1 on the first call, >= 0 after).
            num_cached_tokens: first call only: the prefix hit to take.

        Returns:
            An :class:`Allocation`, or None when it does not fit in some group: then
            nothing changed except ``stats.allocation_failures`` (+1).

        Raises:
            AllocationError: negative counts, more than ``max_alloc_tokens`` on a unified
                pool, or a ``num_cached_tokens`` that is not a
                currently cached, block-aligned prefix leaving >= 1 token to compute.
        """
        # the bound matters to a unified pool's sliding groups only (max_request_tokens)
        if self.unified and self.max_alloc_tokens is not None and num_new_tokens > self.max_alloc_tokens:  # fmt: skip
            raise AllocationError(
                f"num_new_tokens: expected <= max_alloc_tokens={self.max_alloc_tokens}, "
                f"got {num_new_tokens}"
            )
        req = self._reqs.get(request_id)
        if req is None:
            return self._allocate_first(
                request_id, token_ids, num_new_tokens, num_cached_tokens, cache_salt, adapter_id
            )
        if num_new_tokens < 0:
            raise AllocationError(f"num_new_tokens: expected >= 0, got {num_new_tokens}")
        start = req.num_tokens
        end = start + num_new_tokens
        need_blocks = -(-end // self.block_size)
        if self._simple:  # fast path: one full-attention group, no CoW, room to append
            ids = self._groups[0].try_append(req.tables[0], start, num_new_tokens, need_blocks)
            if ids is not None:
                req.num_tokens = end
                st = self._stats
                st.allocations += 1
                st.blocks_allocated += len(ids)
                return Allocation(0, [ids], [[]])
        pending = self._prepare_growth(req, start, num_new_tokens, need_blocks)
        if pending is None:
            self._stats.allocation_failures += 1
            return None
        return self._grow(req, pending, end)

    def _prepare_growth(
        self, req: RequestBlocks, start: int, num_new_tokens: int, need_blocks: int
    ) -> list[PendingGrowth] | None:
        """Every group's growth, or None if one group (a unified pool: all groups
        together) lacks blocks (nothing changed)."""
        pending = []
        check = not self.unified
        for g, gm in enumerate(self._groups):
            growth = gm.prepare_growth(
                req.tables[g], req.freed[g], start, num_new_tokens, need_blocks, check_fit=check
            )
            if growth is None:
                return None
            pending.append(growth)
        if self._shared is not None and sum(p.demand for p in pending) > self._shared.num_free:
            return None
        return pending

    def _grow(self, req: RequestBlocks, pending: list[PendingGrowth], end: int) -> Allocation:
        """Carry out every group's growth and count it in the stats."""
        new_blocks: list[list[int]] = []
        copies: list[list[tuple[int, int]]] = []
        st = self._stats
        # every group's window release first: in a unified pool what one group frees
        # serves another's new blocks in the same call
        for g, (gm, growth) in enumerate(zip(self._groups, pending)):
            if growth.release and req.retention is not None:
                self._retain(req, g, req.freed[g], growth.target)
            gm.release_window(req.tables[g], req.freed[g], growth)
            req.freed[g] = growth.target
        for g, (gm, growth) in enumerate(zip(self._groups, pending)):
            done = gm.extend(req.tables[g], growth)
            st.window_blocks_freed += len(growth.release)
            st.cow_copies += len(done.copies)
            st.blocks_allocated += len(done.new_blocks) + len(done.copies)
            new_blocks.append(done.new_blocks)
            copies.append(done.copies)
        req.num_tokens = end
        st.allocations += 1
        return Allocation(0, new_blocks, copies)

    def _allocate_first(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int,
        num_cached_tokens: int,
        cache_salt: str | None,
        adapter_id: str | None,
        num_swapped_tokens: int = 0,
    ) -> Allocation | None:
        """The first allocation of a request: a prefix hit of ``num_cached_tokens``, or
        (a swap-in, :meth:`allocate_swapped`) ``num_swapped_tokens`` restored by the
        caller; one of them is 0."""
        bs = self.block_size
        if num_new_tokens < 1:
            raise AllocationError(
                f"num_new_tokens: expected >= 1 on the first call, got {num_new_tokens}"
            )
        h = num_cached_tokens
        s = num_swapped_tokens
        extra = encode_extra_keys(cache_salt, adapter_id)
        hb = h // bs
        hit: list[list[int]] = [[] for _ in range(self.num_groups)]
        hashes: list[BlockHash] = []
        if h:
            limit = (len(token_ids) - 1) // bs * bs if self.enable_prefix_caching else 0
            if h < 0 or h % bs or h > limit:
                raise AllocationError(
                    f"num_cached_tokens: expected a multiple of block_size={bs} in [0, {limit}], "
                    f"got {h}"
                )
            hashes = self.prefix_cache.block_hashes(extra, token_ids, hb)
            hit = self.prefix_cache.hit_tables(hashes, h)
        elif s:  # null below the window of position s, as a hit of s tokens leaves it
            hit = [[NULL_BLOCK_ID] * gm.first_needed_block(s) for gm in self._groups]
        nb_end = -(-(h + s + num_new_tokens) // bs)
        n_new = [nb_end - len(ids) for ids in hit]
        if self._shared is not None:
            need = sum(gm.start_demand(ids, k) for gm, ids, k in zip(self._groups, hit, n_new))
            fits = need <= self._shared.num_free
        else:
            fits = all(gm.can_start(ids, k) for gm, ids, k in zip(self._groups, hit, n_new))
        state = self.state
        if state is not None:
            if h and not (state.has_snapshot(hashes[hb - 1]) or state.has_host_snapshot(hashes[hb - 1])):  # fmt: skip
                raise AllocationError(
                    f"num_cached_tokens: expected a state snapshot at position {h}, got none "
                    "(call get_num_cached_tokens right before allocate)"
                )
            if state.num_live_used >= state.num_live_slots:
                fits = False
        if not fits:
            self._stats.allocation_failures += 1
            return None
        if state is not None:
            state.allocate_live(request_id)
            if h:
                state.restore(request_id, hashes[hb - 1])
            if self.enable_prefix_caching:
                full = self._prompt_hashes(extra, token_ids)
                if request_id not in self._observed:  # a readmission is not another pass
                    state.policy.observe(full)
                    self._observed[request_id] = None
                    if len(self._observed) > _OBSERVED_CAP:
                        self._observed.popitem(last=False)
                self._points[request_id] = state.policy.prompt_points(full, len(token_ids), h)
        tables: list[list[int]] = []
        new_blocks: list[list[int]] = []
        freed: list[int] = []
        for gm, ids in zip(self._groups, hit):  # every hit held before any new block
            gm.take_hit(ids)
        for g, gm in enumerate(self._groups):
            ids = gm.allocate_new(n_new[g])
            tables.append(hit[g] + ids)
            new_blocks.append(ids)
            freed.append(gm.first_needed_block(h + s))
        n_tok = h + s + num_new_tokens
        self._reqs[request_id] = RequestBlocks(tables, n_tok, extra, hashes, hb, freed)
        st = self._stats
        by_tier = self.prefix_cache.hit_by_tier(hashes, h)
        st.prefix_queries += 1
        st.prefix_queries_tokens += len(token_ids)
        st.prefix_hits_tokens += h
        st.prefix_hits += 1 if h else 0
        st.allocations += 1
        st.blocks_allocated += sum(n_new)
        return Allocation(h, new_blocks, [[] for _ in range(self.num_groups)], by_tier)

    # ---- swap preemption ----------------------------------------------------------------
    def swap_blocks(self, request_id: str, num_tokens: int) -> list[list[int]]:
        """Per group, the block ids whose content a continuation at position
        ``num_tokens`` needs of the first ``num_tokens`` tokens: table entries
        ``first_needed_block(num_tokens) .. ceil(num_tokens / block_size) - 1`` (a full
        group: all its blocks; a sliding group: those inside the window of the query
        at ``num_tokens``). What swap preemption copies out (``kvpage.engine.swap``),
        and, after :meth:`allocate_swapped`, the blocks it copies back into. Changes
        nothing.

        Raises:
            AllocationError: unknown request, ``num_tokens`` outside ``[0, allocated
                tokens]``, or a needed entry already window-released (null).
        """
        req = self._get(request_id)
        if not 0 <= num_tokens <= req.num_tokens:
            raise AllocationError(
                f"num_tokens: expected in [0, {req.num_tokens}] (allocated positions), "
                f"got {num_tokens}"
            )
        nb = -(-num_tokens // self.block_size)
        out = []
        for g, (gm, table) in enumerate(zip(self._groups, req.tables)):
            ids = table[gm.first_needed_block(num_tokens) : nb]
            if NULL_BLOCK_ID in ids:
                raise AllocationError(
                    f"request {request_id!r} group {g}: expected the blocks of the window "
                    f"at position {num_tokens} held, got a released one in {ids}"
                )
            out.append(ids)
        return out

    def allocate_swapped(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_swapped_tokens: int,
        num_new_tokens: int,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> Allocation | None:
        """First allocation of a swapped-out request readmitted (swap preemption):
        room for positions ``[0, num_swapped_tokens + num_new_tokens)`` where the K/V of
        the first ``num_swapped_tokens`` are copied back by the caller before the next
        forward (into :meth:`swap_blocks` ``(request_id, num_swapped_tokens)``). Each
        group's table holds the null block below ``first_needed_block(num_swapped_tokens)``
        (exactly what a prefix hit of that many tokens leaves: a sliding group never
        holds, nor later registers as cached, blocks whose content was not kept) and new
        blocks from there on. No block is taken from the prefix cache; the blocks are
        hashed and registered by :meth:`commit` after the step, as for a computed
        prefill. ``num_new_tokens`` (>= 1) is bounded by ``max_alloc_tokens`` on a
        unified pool, the swapped tokens are not (a sliding group holds only their
        window). With state layers a live state slot is taken (the caller writes the
        swapped state into it).

        Returns:
            The :class:`Allocation` (``num_cached_tokens`` 0), or None when it does not
            fit: nothing changed except ``stats.allocation_failures`` (+1).

        Raises:
            AllocationError: a request that holds blocks already, ``num_swapped_tokens``
                < 1, ``num_new_tokens`` < 1 or above ``max_alloc_tokens`` (unified), or
                more tokens than ``len(token_ids)`` (nothing changed).
        """
        if request_id in self._reqs:
            raise AllocationError(
                f"request_id: expected a request holding no blocks, got {request_id!r}"
            )
        s, n = num_swapped_tokens, num_new_tokens
        if s < 1 or s + n > len(token_ids):
            raise AllocationError(
                f"num_swapped_tokens: expected in [1, len(token_ids) - num_new_tokens = "
                f"{len(token_ids) - n}], got {s}"
            )
        if self.unified and self.max_alloc_tokens is not None and n > self.max_alloc_tokens:
            raise AllocationError(
                f"num_new_tokens: expected <= max_alloc_tokens={self.max_alloc_tokens}, got {n}"
            )
        return self._allocate_first(request_id, token_ids, n, 0, cache_salt, adapter_id, s)

    # ---- fit queries (read-only: the scheduler's budget on a unified pool) ------------
    @property
    def has_transient_blocks(self) -> bool:
        """Whether a request can hold more blocks than it needs once settled: a unified
        pool with a sliding-window group. A call for ``[s, s + n)`` leaves a sliding group
        holding blocks ``(s - W + 1) // bs .. ceil((s + n) / bs) - 1`` until the request's
        next allocation releases those below the window, so a long prefill chunk holds up
        to ``n / bs`` blocks per sliding group that its next step gives back (per-group
        pools: a sliding group never holds more than the full group, in a pool of the
        same size). The scheduler budgets admission and prefill chunks with
        :meth:`admission_demand`, :meth:`growth_demand` and :meth:`fit_new_tokens` only
        then (``kvpage.engine.scheduler``)."""
        return self.unified and any(w is not None for w in self.windows)

    def _settled_blocks(self, num_tokens: int) -> int:
        """Blocks (all groups) a request of ``num_tokens`` computed tokens holds once its
        window is released up to the next query: per group ``ceil(T / bs) -
        first_needed_block(T)`` (full groups: ``ceil(T / bs)``)."""
        nb = -(-num_tokens // self.block_size)
        return sum(nb - gm.first_needed_block(num_tokens) for gm in self._groups)

    def growth_demand(self, request_id: str, num_tokens: int) -> int:
        """Net free-queue blocks ``request_id`` needs to hold ``num_tokens`` (>= its
        allocated positions) settled: per group the blocks appended up to ``ceil(T /
        bs)``, less the blocks below ``first_needed_block(T)`` that it alone holds (its
        window release frees them; a prefill chunk's transient blocks among them); 0
        when that is negative. Changes nothing.

        Raises:
            AllocationError: unknown request.
        """
        req = self._get(request_id)
        nb = -(-num_tokens // self.block_size)
        total = 0
        for gm, table, freed in zip(self._groups, req.tables, req.freed):
            total += max(0, nb - len(table))
            target = gm.first_needed_block(num_tokens)
            if target > freed:
                total -= gm.pool.count_exclusive(table[freed:target])
        return max(0, total)

    def admission_demand(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        *,
        num_cached_tokens: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int:
        """Free-queue blocks a new request takes to hold ``num_tokens`` settled
        (:meth:`_settled_blocks`) with the prefix hit ``num_cached_tokens`` (from
        :meth:`get_num_cached_tokens`): the settled blocks minus the hit blocks other
        requests hold (they are shared, not taken; cached free ones are revived from the
        free queue and count). Changes no block, table or stat.

        Raises:
            AllocationError: a ``num_cached_tokens`` that is not cached now.
        """
        need = self._settled_blocks(num_tokens)
        h = num_cached_tokens
        if not h:
            return need
        bs = self.block_size
        hashes = self.prefix_cache.block_hashes(
            encode_extra_keys(cache_salt, adapter_id), token_ids, h // bs
        )
        for gm, ids in zip(self._groups, self.prefix_cache.hit_tables(hashes, h)):
            kept = ids[gm.first_needed_block(num_tokens) :]
            need -= sum(1 for i in kept if i) - gm.pool.count_free(kept)
        return need

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
    ) -> int:
        """The most tokens ``m <= num_new_tokens`` that ``allocate(request_id, token_ids,
        m, ...)`` (same arguments; with ``num_swapped_tokens`` ``s > 0``, a first call
        only: ``allocate_swapped(request_id, token_ids, s, m, ...)``) would make room for
        while leaving at least ``keep_free`` blocks free (per-group pools: in every
        group's pool); 0 when not even one fits (a first call) or when none fit. A group's demand grows with
        ``m`` (``ceil((s + m) / bs)`` blocks; the window release and a CoW copy do not
        depend on it), so the answer is a binary search over ``m``. Changes nothing.

        Raises:
            AllocationError: negative counts, a ``num_cached_tokens`` that is not
                cached now (first call), or ``num_swapped_tokens`` with a prefix hit or
                on a later call.
        """
        s = num_swapped_tokens
        if num_new_tokens < 0 or keep_free < 0 or s < 0:
            raise AllocationError(
                f"num_new_tokens, keep_free, num_swapped_tokens: expected >= 0, got "
                f"{num_new_tokens}, {keep_free}, {s}"
            )
        bs = self.block_size
        req = self._reqs.get(request_id)
        if s and (num_cached_tokens or req is not None):
            raise AllocationError(
                f"num_swapped_tokens: expected 0 with a prefix hit or on a later call, got {s}"
            )
        if req is None:  # a first call: per group the hit's free blocks + new blocks
            if num_new_tokens == 0 or (
                self.state is not None and self.state.num_live_used >= self.state.num_live_slots
            ):
                return 0
            h = num_cached_tokens
            hit: list[list[int]] = [[] for _ in self._groups]
            if h:
                extra = encode_extra_keys(cache_salt, adapter_id)
                hit = self.prefix_cache.hit_tables(
                    self.prefix_cache.block_hashes(extra, token_ids, h // bs), h
                )
            if s:  # a swap-in: null entries below the window of s, no hit block
                start, lens = s, [gm.first_needed_block(s) for gm in self._groups]
            else:
                start, lens = h, [h // bs] * self.num_groups
            fixed = [gm.start_demand(ids, 0) for gm, ids in zip(self._groups, hit)]
        else:
            start = req.num_tokens
            need = -(-(start + num_new_tokens) // bs)
            lens = [len(t) for t in req.tables]
            fixed = []  # per group: CoW copy - window blocks its release frees
            for g, gm in enumerate(self._groups):
                p = gm.prepare_growth(
                    req.tables[g], req.freed[g], start, num_new_tokens, need, check_fit=False
                )
                assert p is not None
                fixed.append(p.demand - p.num_new)
        pools = self.block_pools
        free = [p.num_free for p in pools]

        def fits(m: int) -> bool:
            nb = -(-(start + m) // bs)
            demand = [max(0, nb - n) + f for n, f in zip(lens, fixed)]
            if self._shared is not None:
                return sum(demand) <= free[0] - keep_free
            return all(d <= fr - keep_free for d, fr in zip(demand, free))

        lo = 1 if req is None else 0
        if not fits(lo):
            return 0
        hi = num_new_tokens
        while lo < hi:  # the most m with fits(m)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register blocks fully inside ``[0, num_computed_tokens)`` as prefix-cache
        entries (call after the step that wrote their K/V ran; C04).

        A block whose content another block already holds stays unregistered (the
        existing entry is kept). No-op when prefix caching is off.

        Raises:
            AllocationError: unknown request, or ``num_computed_tokens`` above the
                allocated tokens or ``len(token_ids)``.
        """
        req = self._reqs.get(request_id)
        if req is None:
            req = self._get(request_id)  # raises
        if num_computed_tokens > req.num_tokens or num_computed_tokens > len(token_ids):
            raise AllocationError(
                f"num_computed_tokens: expected <= min(allocated={req.num_tokens}, "
                f"len(token_ids)={len(token_ids)}), got {num_computed_tokens}"
            )
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        nfull = num_computed_tokens // bs
        i0 = req.num_committed
        if nfull <= i0:
            return
        self._commit_blocks(req, token_ids, nfull)
        if self.state is not None:
            self._take_snapshot(request_id, req, token_ids, num_computed_tokens)

    def _commit_blocks(self, req: RequestBlocks, token_ids: Sequence[int], nfull: int) -> None:
        """Hash and register blocks ``num_committed .. nfull - 1`` (see :meth:`commit`)."""
        bs = self.block_size
        i0 = req.num_committed
        hashes = req.hashes
        parent = hashes[-1] if hashes else self.prefix_cache.root
        extra = req.extra
        tables = req.tables
        groups = self._groups
        if nfull - i0 == 1:  # decode: one block filled up, skip the generator
            new_hashes = [chain_hash(parent, extra, token_ids[i0 * bs : nfull * bs])]
        else:
            new_hashes = list(iter_block_hashes(parent, extra, token_ids, bs, i0, nfull))
        for i, h in enumerate(new_hashes, i0):
            hashes.append(h)
            for g, gm in enumerate(groups):
                gm.commit(tables[g], i, h)
        req.num_committed = nfull

    def _take_snapshot(
        self, request_id: str, req: RequestBlocks, token_ids: Sequence[int], n_done: int
    ) -> None:
        """After a step whose last computed token ends at block boundary ``n_done``:
        take the policy's snapshot there (a prefill point, or the rolling decode one
        when the sequence is computed to its end)."""
        state = self.state
        assert state is not None
        bs = self.block_size
        if n_done % bs or not state.has_live(request_id):
            return
        kind = None
        points = self._points.get(request_id)
        while points and points[0].position <= n_done:
            p = points.pop(0)
            if p.position == n_done:
                kind = p.kind
        if kind is None and n_done == len(token_ids) and state.policy.decode_snapshots:
            kind = "decode"
        if kind is None:
            return
        prio, ttl = PRIORITY_DEFAULT, None
        if req.retention is not None:
            policy, n_prompt = req.retention
            blk = n_done // bs - 1
            for a, b, pr, t in policy.block_spans(n_prompt, bs, blk + 1):
                if a <= blk < b:
                    prio, ttl = pr, t
        state.take(request_id, req.hashes[n_done // bs - 1], kind, priority=prio, ttl_s=ttl)

    def state_chunk_end(
        self,
        request_id: str,
        token_ids: Sequence[int],
        start: int,
        end: int,
        *,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
    ) -> int:
        """Where a chunk computing positions ``[start, end)`` must end so that every
        snapshot boundary the policy wants lies at the end of some step: the first wanted
        boundary inside ``(start, end)``, else ``end`` (always ``end`` without state
        layers or prefix caching). For a request not allocated yet (its first admission,
        ``start`` = its hit) the boundaries are those its :meth:`allocate` will prepare.
        Changes nothing."""
        state = self.state
        if state is None or not self.enable_prefix_caching or end - start <= 1:
            return end
        points = self._points.get(request_id)
        if points is None:
            if request_id in self._reqs:
                return end
            extra = encode_extra_keys(cache_salt, adapter_id)
            full = self._prompt_hashes(extra, token_ids)
            points = state.policy.prompt_points(full, len(token_ids), start, self_pass=True)
        return state.policy.chunk_end(start, end, points)

    def _prompt_hashes(self, extra: bytes, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes of every full block of ``token_ids`` (the snapshot policy's
        boundaries), remembered for the next call on the same tokens and keys (an
        admission asks for them up to three times: chunk end, allocation, explanation)."""
        memo = self._hash_memo
        if memo is not None and memo[0] == extra and memo[1] == token_ids:
            return memo[2]
        nb = len(token_ids) // self.block_size
        hashes = self.prefix_cache.block_hashes(extra, token_ids, nb)
        self._hash_memo = (extra, list(token_ids), hashes)
        return hashes

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The state slot copies ``(src, dst)`` queued since the last call, in order
        (``StatePool.take_copies``); the engine runs all of them before the next
        forward. Empty without state layers."""
        return [] if self.state is None else self.state.take_copies()

    def state_slot(self, request_id: str) -> int:
        """The live state slot of ``request_id``.

        Raises:
            AllocationError: no state layers, or the request holds no slot.
        """
        if self.state is None:
            raise AllocationError("state_slot: expected a model with state layers, got none")
        return self.state.live_slot(request_id)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Roll a request back to its first ``num_tokens`` positions: the positions
        allocated past them are dropped and every block wholly past them goes back to the
        free queue (last first), unhashed (speculative decoding's rejected drafts,
        ``kvpage.engine.spec_decode``). Committed blocks are never dropped: they hold
        only computed, accepted tokens.

        Raises:
            AllocationError: unknown request, ``num_tokens`` above the allocated
                positions, or below the committed (hashed) blocks' tokens.
        """
        req = self._get(request_id)
        if self.state is not None and num_tokens != req.num_tokens:
            raise AllocationError(
                "truncate: expected no rollback on a model with recurrent state layers (a "
                "recurrent state cannot be rolled back to an earlier token), got "
                f"{req.num_tokens} -> {num_tokens}"
            )
        bs = self.block_size
        lo = req.num_committed * bs
        if not lo <= num_tokens <= req.num_tokens:
            raise AllocationError(
                f"num_tokens: expected in [{lo}, {req.num_tokens}] (committed .. allocated "
                f"positions), got {num_tokens}"
            )
        keep = -(-num_tokens // bs)
        for gm, table in zip(self._groups, req.tables):
            if len(table) > keep:
                gm.free(table[keep:])
                del table[keep:]
        req.num_tokens = num_tokens

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's blocks (ref counts +1), hashes and token count.

        Raises:
            AllocationError: unknown parent or existing child.
        """
        p = self._get(parent_id)
        if child_id in self._reqs:
            raise AllocationError(f"child_id: expected a new request id, got {child_id!r}")
        if self.state is not None:
            self.state.fork_live(parent_id, child_id)  # raises first: nothing changed
            pts = self._points.get(parent_id)
            if pts is not None:
                self._points[child_id] = list(pts)
        for gm, table in zip(self._groups, p.tables):
            gm.fork(table)
        self._reqs[child_id] = RequestBlocks(
            [list(t) for t in p.tables],
            p.num_tokens,
            p.extra,
            list(p.hashes),
            p.num_committed,
            list(p.freed),
            p.retention,
        )

    def free(self, request_id: str) -> None:
        """Release all of a request's blocks, last block first, to the free queue.

        Raises:
            AllocationError: unknown request (never allocated, or already freed).
        """
        req = self._get(request_id)
        del self._reqs[request_id]
        if self.state is not None:
            self.state.free_live(request_id)
            self._points.pop(request_id, None)
        if req.retention is not None:
            for g, table in enumerate(req.tables):
                self._retain(req, g, 0, len(table))
        for gm, table in zip(self._groups, req.tables):
            gm.free(table)

    # ---- prefix cache -------------------------------------------------------------------
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
        the pool: cached blocks, evictions, tier contents; never a table or stat here);
        with state layers only up to the deepest state snapshot of the prompt, where
        the hit would end anyway.
        """
        extra = encode_extra_keys(cache_salt, adapter_id)
        if self.state is None:
            return self.prefix_cache.lookup(token_ids, extra)
        bs = self.block_size
        cap = None
        if self.prefix_cache.tiers is not None:  # promote no KV past the deepest snapshot
            cap = self.state.deepest(self._prompt_hashes(extra, token_ids), (len(token_ids) - 1) // bs)  # fmt: skip
        kv = self.prefix_cache.lookup(token_ids, extra, cap)
        hashes = self.prefix_cache.block_hashes(extra, token_ids, kv // bs) if kv else []
        hit = self.state.lookup(hashes, kv // bs) * bs  # a disk snapshot is promoted
        self._state_lookup = (extra, list(token_ids[:kv]), kv, hit)
        return hit

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
        extra = encode_extra_keys(cache_salt, adapter_id)
        look = self._state_lookup
        if (
            self.state is not None
            and look is not None
            and look[0] == extra
            and look[3] == num_cached_tokens
            and look[1] == list(token_ids[: look[2]])
        ):
            bs = self.block_size
            kv = look[2]  # the KV hit; with tiers, what they hold past the promotion cap
            tiers = self.prefix_cache.tiers
            if tiers is not None:
                kv = max(kv, bs * tiers.prefix_blocks(self.prefix_cache.root, extra, token_ids, bs))  # fmt: skip
            if kv > num_cached_tokens:
                if remember_key:  # records the key (the lookup's own hit: hashes known)
                    self.prefix_cache.explain_miss(token_ids, look[2], extra, True)
                full = self._prompt_hashes(extra, token_ids)
                near = self.state.nearest(full, kv // bs)
                return CacheMissExplanation(
                    "no_state_snapshot",
                    len(token_ids),
                    num_cached_tokens,
                    num_cached_tokens // bs,
                    state_position=kv,
                    state_nearest=None if near is None else near * bs,
                    state_refused=self.state.refusal(full[kv // bs - 1]),
                )
        return self.prefix_cache.explain_miss(token_ids, num_cached_tokens, extra, remember_key)

    def attach_tiers(self, tiers: TieredCache) -> None:
        """Put KV tiers below the pool: prefix lookups then promote blocks found in a
        tier (``kvpage.cache.tiered``). ``tiers`` must be built over :attr:`pools`
        (one full-attention group: ``pools[0]``; a unified pool: every group's view, in
        group order, each group keyed by ``tiered.tier_key``); each group's
        ``first_needed_block`` is bound to ``tiers.first_needed``. The tiers' drops are
        recorded for miss explanations
        (:class:`~kvpage.cache.prefix_cache.TierEvictionRecorder`).

        Raises:
            SpecError: several KV groups outside a unified pool or a lone sliding-window
                group, prefix caching off, or other pools.
        """
        self.prefix_cache.attach_tiers(tiers)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash entry (and state snapshot) if no request holds blocks; False
        (no change) otherwise."""
        if self._reqs and self.state is not None:
            return False
        done = self.prefix_cache.reset()
        if done and self.state is not None:
            self.state.reset()
        return done

    # ---- retention ----------------------------------------------------------------------
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

    # ---- queries ------------------------------------------------------------------------
    @property
    def pools(self) -> list[BlockPool | GroupPool]:
        """Per group, its pool (a unified pool: its view of the shared pool), for
        inspection (tests, debugging); mutate them only through this manager."""
        return list(self._pools)

    @property
    def shared_pool(self) -> BlockPool | None:
        """The one pool all groups share (``unified``), None with per-group pools."""
        return self._shared

    @property
    def block_pools(self) -> list[BlockPool]:
        """The distinct pools holding blocks: the shared pool, or one per group."""
        if self._shared is not None:
            return [self._shared]
        return [p for p in self._pools if isinstance(p, BlockPool)]

    def used_blocks_by_group(self) -> list[int]:
        """Per group, blocks held by requests (O(num_blocks): for reports and tests)."""
        if self._shared is not None:
            return self._shared.num_used_by_group()
        return [p.num_used for p in self._pools]

    @property
    def prefix_pools(self) -> list[BlockPool | GroupPool]:
        """The pools whose hash maps decide a prefix hit: those of the full-attention
        groups (all pools when every group is sliding-window). A KV-event publisher
        (``kvpage.routing``) listens to these; mutate them only through this manager."""
        return self.prefix_cache.prefix_pools

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1] (the shared pool's; per-group
        pools: max over groups); cached blocks nobody holds count as free."""
        return max((p.usage for p in self.block_pools), default=0.0)

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (cached-but-unreferenced included) of the shared pool; per-group
        pools: min over groups."""
        return min((p.num_free for p in self.block_pools), default=0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests (the shared pool: all groups; per-group pools: max
        over groups)."""
        return max((p.num_used for p in self.block_pools), default=0)

    @property
    def num_retained_blocks(self) -> int:
        """Free blocks held at a raised retention priority (max over pools)."""
        return max((p.num_retained for p in self.block_pools), default=0)

    @property
    def max_retained_blocks(self) -> int:
        """The retention cap per pool (blocks)."""
        return self._pools[0].max_retained_blocks if self._pools else 0

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        return replace(self._stats, evictions=sum(p.num_evictions for p in self.block_pools))

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
        call: ``ceil(num_tokens / block_size)`` (max over groups; a unified pool gives
        that to each of its groups)."""
        return -(-max(num_tokens, 0) // self.block_size)

    def check_integrity(self) -> None:
        """Verify pool and table invariants. Raises IntegrityError with the numbers."""
        check_manager_integrity(
            self._pools, self._reqs, self.block_size, self.enable_prefix_caching, self._shared
        )
        if self.state is not None:
            self.state.check_integrity(list(self._reqs))

    def _get(self, request_id: str) -> RequestBlocks:
        req = self._reqs.get(request_id)
        if req is None:
            raise AllocationError(f"request_id: expected an allocated request, got {request_id!r}")
        return req


__all__ = ["Allocation", "CacheStats", "KVCacheManager"]
