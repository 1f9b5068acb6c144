"""Prefix-cache eviction study on hash-id traces (Mooncake): how much of the unbounded
cache's hit ratio survives at a finite capacity, per eviction policy.

Model (timing-free, like the "causal" statistics of the traces' README): requests are
walked in file order; a request hits the leading run of its hash blocks that are in the
cache (prefix caching can reuse only a leading run); then all its blocks are in the
cache (the hit ones touched, the missed ones inserted), evicting others when the cache
holds more than ``capacity`` blocks. The request's own blocks are never evicted while it
is inserted. Units are the trace's 512-token hash blocks.

Policies:

* ``lru`` — least recently used, with a request's blocks touched **last block first**, so
  its first blocks are the most recent: this is kvpage's ``KVCacheManager`` order (free
  appends a request's blocks to the free-queue tail in reverse, vLLM v1's order), which
  evicts the tails of chains before their shared heads.
* ``lru-forward`` — plain LRU touching blocks first to last (the naive order, for contrast).
* ``lfu`` — fewest hits first (ties: least recent); frequency counts survive eviction.
* ``leaf-lru`` — LRU among *leaves* of the prefix tree only (cached blocks no cached
  block depends on; SGLang's RadixAttention evicts this way), so no chain is cut in the
  middle.
* ``slru`` — segmented LRU (Karedla et al., IEEE Computer 1994): new blocks enter a
  probation segment, blocks hit at least once move to a protected segment of at most
  ``protected_fraction`` of the capacity; eviction takes probation's LRU first. The
  fraction 0.2 was picked on the Mooncake conversation trace itself (0.05, 0.2, 0.5
  tried; 0.8, the textbook value, was worse than LRU), so its margin is optimistic.
  Scan-resistant: long one-off prompts (most blocks of the trace are used once) cannot
  flush the blocks that conversations come back to. Touch order as ``lru``.
* ``belady`` — evict the block whose next reference is farthest in the future (offline,
  needs the whole trace: an upper-bound reference, not a deployable policy).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvpage.errors import SpecError
from kvpage.workload.traces import Trace

EVICTION_POLICIES = ("lru", "lru-forward", "lfu", "leaf-lru", "slru", "belady")


@dataclass
class EvictionResult:
    """Hit ratio of one policy at one capacity.

    Attributes:
        policy: the policy.
        capacity_blocks: cache size in hash blocks (None = unbounded).
        block_hit_pct: hit blocks / all prompt blocks, %.
        token_hit_pct: ``min(hit_blocks * 512, prompt)`` / prompt tokens, %.
        evictions: blocks evicted.
    """

    policy: str
    capacity_blocks: int | None
    block_hit_pct: float
    token_hit_pct: float
    evictions: int


def simulate_eviction(
    trace: Trace, capacity_blocks: int | None, policy: str = "lru"
) -> EvictionResult:
    """Run the timing-free prefix-cache model (module docstring) on ``trace``.

    Raises:
        SpecError: unknown policy, capacity < 1, or a trace without hash ids.
    """
    if policy not in EVICTION_POLICIES:
        raise SpecError(f"policy: expected one of {EVICTION_POLICIES}, got {policy!r}")
    if capacity_blocks is not None and capacity_blocks < 1:
        raise SpecError(f"capacity_blocks: expected None or >= 1, got {capacity_blocks}")
    if not trace.has_hash_ids:
        raise SpecError(f"trace: expected hash ids (Mooncake format), got {trace.format!r}")
    ids: list[Sequence[int]] = [r.hash_ids or () for r in trace.requests]
    hb = trace.hash_block_tokens
    cap = capacity_blocks if capacity_blocks is not None else 1 << 62
    cache = _make_cache(policy, ids, cap)
    hit_b = tot_b = hit_t = tot_t = 0
    for i, (r, h) in enumerate(zip(trace.requests, ids)):
        run = 0
        for b in h:
            if not cache.contains(b):
                break
            run += 1
        cache.access(i, h, run)
        hit_b += run
        tot_b += len(h)
        hit_t += min(run * hb, r.prompt_tokens)
        tot_t += r.prompt_tokens
    return EvictionResult(
        policy,
        capacity_blocks,
        100.0 * hit_b / max(tot_b, 1),
        100.0 * hit_t / max(tot_t, 1),
        cache.evictions,
    )


class _Cache:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.evictions = 0
        self.clock = 0

    def contains(self, b: int) -> bool:
        raise NotImplementedError

    def access(self, i: int, h: Sequence[int], run: int) -> None:
        raise NotImplementedError


class _LRU(_Cache):
    def __init__(self, cap: int, reverse: bool) -> None:
        super().__init__(cap)
        self.od: OrderedDict[int, None] = OrderedDict()
        self.reverse = reverse

    def contains(self, b: int) -> bool:
        return b in self.od

    def access(self, i: int, h: Sequence[int], run: int) -> None:
        od = self.od
        for b in reversed(h) if self.reverse else h:
            if b in od:
                od.move_to_end(b)
            else:
                od[b] = None
        protect = set(h)
        while len(od) > self.cap:
            b = next(iter(od))
            if b in protect:  # request larger than the cache: drop its oldest-touched
                od.move_to_end(b)
                if len(protect) >= len(od):
                    od.popitem(last=False)
                    self.evictions += 1
                continue
            od.popitem(last=False)
            self.evictions += 1


class _SLRU(_Cache):
    def __init__(self, cap: int, protected_fraction: float = 0.2) -> None:
        super().__init__(cap)
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()
        self.prot_cap = max(1, int(cap * protected_fraction)) if cap < 1 << 61 else cap

    def contains(self, b: int) -> bool:
        return b in self.prob or b in self.prot

    def access(self, i: int, h: Sequence[int], run: int) -> None:
        prob, prot = self.prob, self.prot
        for j in range(len(h) - 1, -1, -1):
            b = h[j]
            if j < run:  # a hit: promote
                prob.pop(b, None)
                prot[b] = None
                prot.move_to_end(b)
            elif b in prot:
                prot.move_to_end(b)
            else:
                prob[b] = None
                prob.move_to_end(b)
        while len(prot) > self.prot_cap:
            b, _ = prot.popitem(last=False)
            prob[b] = None  # demoted to probation's MRU end
        protect = set(h)
        while len(prob) + len(prot) > self.cap:
            seg = prob if prob else prot
            b = next(iter(seg))
            if b in protect and len(protect) < len(prob) + len(prot):
                seg.move_to_end(b)
                protect.discard(b)  # look at it once; then it may go
                continue
            seg.popitem(last=False)
            self.evictions += 1


class _HeapCache(_Cache):
    """Evicts the cached block with the smallest key (lazy-deletion heap)."""

    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.key: dict[int, tuple[float, ...]] = {}
        self.heap: list[tuple[tuple[float, ...], int]] = []

    def contains(self, b: int) -> bool:
        return b in self.key

    def _set(self, b: int, k: tuple[float, ...]) -> None:
        self.key[b] = k
        heapq.heappush(self.heap, (k, b))

    def _evict_one(self, protect: set[int]) -> None:
        skipped = []
        while self.heap:
            k, b = heapq.heappop(self.heap)
            if self.key.get(b) != k or not self._evictable(b):
                continue  # stale entry, or an inner node (re-offered when it becomes a leaf)
            if b in protect:
                skipped.append((k, b))
                continue
            del self.key[b]
            self._on_evict(b)
            self.evictions += 1
            break
        else:  # everything protected: evict a protected block after all
            if skipped:
                k, b = skipped.pop(0)
                del self.key[b]
                self._on_evict(b)
                self.evictions += 1
        for item in skipped:
            heapq.heappush(self.heap, item)

    def _evictable(self, b: int) -> bool:
        return True

    def _on_evict(self, b: int) -> None:
        pass

    def _shrink(self, h: Sequence[int]) -> None:
        protect = set(h)
        while len(self.key) > self.cap:
            self._evict_one(protect)


class _LFU(_HeapCache):
    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.freq: dict[int, int] = {}

    def access(self, i: int, h: Sequence[int], run: int) -> None:
        for j, b in enumerate(reversed(h)):
            self.clock += 1
            f = self.freq.get(b, 0) + (1 if len(h) - 1 - j < run else 0)
            self.freq[b] = f
            self._set(b, (f, self.clock))
        self._shrink(h)


class _LeafLRU(_HeapCache):
    def __init__(self, cap: int) -> None:
        super().__init__(cap)
        self.children: dict[int, int] = {}  # cached children per cached block
        self.parent: dict[int, int | None] = {}

    def access(self, i: int, h: Sequence[int], run: int) -> None:
        prev: int | None = None
        for b in h:
            self.clock += 1
            if b not in self.key:
                self.parent[b] = prev
                self.children.setdefault(b, 0)
                if prev is not None:
                    self.children[prev] = self.children.get(prev, 0) + 1
            self._set(b, (self.clock,))
            prev = b
        self._shrink(h)

    def _evictable(self, b: int) -> bool:
        return self.children.get(b, 0) == 0

    def _on_evict(self, b: int) -> None:
        p = self.parent.pop(b, None)
        self.children.pop(b, None)
        if p is not None and p in self.children:
            self.children[p] -= 1
            if self.children[p] == 0 and p in self.key:  # became a leaf: re-offer it
                heapq.heappush(self.heap, (self.key[p], p))


class _Belady(_HeapCache):
    def __init__(self, cap: int, ids: list[Sequence[int]]) -> None:
        super().__init__(cap)
        nxt: list[list[int]] = [[0] * len(h) for h in ids]
        last: dict[int, int] = {}
        for i in range(len(ids) - 1, -1, -1):
            for j, b in enumerate(ids[i]):
                nxt[i][j] = last.get(b, 1 << 60)
            for b in ids[i]:
                last[b] = i
        self.nxt = nxt

    def access(self, i: int, h: Sequence[int], run: int) -> None:
        for j, b in enumerate(h):
            self._set(b, (-float(self.nxt[i][j]),))
        self._shrink(h)


def _make_cache(policy: str, ids: list[Sequence[int]], cap: int) -> _Cache:
    if policy == "lru":
        return _LRU(cap, reverse=True)
    if policy == "lru-forward":
        return _LRU(cap, reverse=False)
    if policy == "lfu":
        return _LFU(cap)
    if policy == "leaf-lru":
        return _LeafLRU(cap)
    if policy == "slru":
        return _SLRU(cap)
    return _Belady(cap, ids)


__all__ = ["EVICTION_POLICIES", "EvictionResult", "simulate_eviction"]
