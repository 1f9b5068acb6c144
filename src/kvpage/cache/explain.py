"""Cache-miss explanations: why a request's prompt stopped matching the prefix cache.

The manager (``KVCacheManager.explain_miss``) looks at the first block of the prompt
the hit did not cover and names one reason (:data:`MISS_REASONS`):

* ``full_hit``: every block that can be a hit was one; only the tail is computed (the
  partial last block, which is never cached, and the last prompt token, always
  computed so the model has logits to sample);
* ``no_full_block``: the prompt has no full block before its last token (at most
  ``block_size`` tokens), so there is nothing a cache could serve;
* ``never_seen``: no block with this content under this request's cache key is cached
  or in the eviction record (so: never seen, or evicted longer ago than the record
  remembers, see :data:`DEFAULT_EVICTION_RECORD_CAP`);
* ``evicted``: the block was cached and evicted: from which tier, when, by which
  policy (:class:`EvictionRecord`; any tier reports through
  :meth:`EvictionRecord.record_eviction`, the device pool through
  :class:`PoolEvictionRecorder` on the ``BlockPool.listeners`` seam);
* ``different_cache_key``: the same tokens are cached under another cache salt /
  tenant / adapter key seen recently (:class:`KeyRecord`). This reveals that someone
  else sent these tokens, so it is an *operator* reason: per-request views shown to a
  tenant must report it as ``never_seen`` (:meth:`CacheMissExplanation.public`);
* ``sliding_window``: the full-attention groups hold the next block, but a
  sliding-window group lacks blocks the first computed token must see;
* ``no_state_snapshot``: a hybrid model (recurrent layers): the attention KV covers the
  prompt up to position ``p`` (``state_position``) but no recurrent-state snapshot
  exists there, so the hit ended at an earlier snapshot; ``state_nearest`` is the
  snapshot boundary along the prompt nearest to ``p`` (None = none)
  (``kvpage.cache.state_pool``);
* ``hit_not_taken``: every group could serve the next block, but the caller took a
  shorter hit (the engine never does; an API caller passing less than the lookup);
* ``prefix_caching_disabled`` and ``prompt_logprobs`` (the engine computes every prompt
  token of such a request): no lookup was made.

Memory is bounded: the eviction record keeps the last ``cap`` evictions (oldest
eviction forgotten first; ~155 bytes each measured with ``tracemalloc``: ~90 for the
ring slot and dict entry plus the 65-byte hash object), the key record the last
:data:`DEFAULT_KEY_RECORD_CAP` keys.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvpage.cache.free_queue import NUM_PRIORITY_LEVELS, PRIORITY_DEFAULT, PRIORITY_LOW
from kvpage.cache.hashing import BlockHash, chain_hash, iter_block_hashes

#: every reason a :class:`CacheMissExplanation` can carry
MISS_REASONS = (
    "full_hit",
    "no_full_block",
    "never_seen",
    "evicted",
    "different_cache_key",
    "sliding_window",
    "no_state_snapshot",
    "hit_not_taken",
    "prefix_caching_disabled",
    "prompt_logprobs",
)
#: what each reason suggests to an operator (the last column of the replay/simulate
#: tables)
MISS_ADVICE = {
    "full_hit": "nothing to gain: only the partial last block was computed",
    "no_full_block": "prompt shorter than one block plus a token: nothing is cacheable",
    "never_seen": "new content: no cache can help",
    "evicted": "buy memory or add a host/disk tier (or retain the prefix)",
    "different_cache_key": "same tokens under another salt/tenant/adapter: check routing "
    "and the cache scope",
    "sliding_window": "a sliding-window group dropped the window's blocks: more memory",
    "no_state_snapshot": "the recurrent state was not snapshotted there: raise "
    "state_snapshot_share or lower state_share_threshold",
    "hit_not_taken": "the block was cached but a shorter hit was taken",
    "prefix_caching_disabled": "turn prefix caching on",
    "prompt_logprobs": "prompt_logprobs requests compute every token",
}
#: evictions remembered: ~155 bytes each (module docstring), so ~10 MB at the default
DEFAULT_EVICTION_RECORD_CAP = 65536
#: distinct cache keys (salt, adapter) remembered for the ``different_cache_key`` check
DEFAULT_KEY_RECORD_CAP = 8
#: the ``different_cache_key`` check hashes at most this many blocks per other key
MAX_CROSS_KEY_BLOCKS = 256


@dataclass(frozen=True)
class CacheMissExplanation:
    """Why a request's prefix-cache hit ended where it did.

    Attributes:
        reason: one of :data:`MISS_REASONS`.
        num_prompt_tokens: the prompt's length in tokens.
        num_cached_tokens: tokens served from the cache (all tiers).
        first_miss_block: index of the first block that was not a hit (None for
            ``full_hit``, ``no_full_block`` and when no lookup was made).
        tier: ``evicted``: the tier it was evicted from ("device", or a lower tier).
        policy: ``evicted``: the eviction policy that chose it (e.g. "lru",
            "lru:low-priority", "lru:retained", "reset").
        evicted_at: ``evicted``: ``time.monotonic()`` seconds of the eviction.
        state_position: ``no_state_snapshot``: tokens the attention KV covered.
        state_nearest: ``no_state_snapshot``: the nearest snapshot boundary (tokens).
        state_refused: ``no_state_snapshot``: why the disk tier's snapshot at
            ``state_position`` was refused on read (``"corrupt"``, ``"size"``:
            ``kvpage.cache.state_pool.StatePool.refusal``), None when there was none.
    """

    reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    first_miss_block: int | None = None
    tier: str | None = None
    policy: str | None = None
    evicted_at: float | None = None
    state_position: int | None = None
    state_nearest: int | None = None
    state_refused: str | None = None

    @property
    def message(self) -> str:
        """One line for people: the reason, with the positions of ``no_state_snapshot``
        ("no state snapshot at position p (nearest q)")."""
        if self.reason == "no_state_snapshot":
            near = "none" if self.state_nearest is None else str(self.state_nearest)
            why = "" if self.state_refused is None else f"; disk snapshot {self.state_refused}"
            return f"no state snapshot at position {self.state_position} (nearest {near}{why})"
        return self.reason.replace("_", " ")

    @property
    def num_missed_tokens(self) -> int:
        """Prompt tokens computed rather than served from the cache."""
        return self.num_prompt_tokens - self.num_cached_tokens

    def public(self) -> CacheMissExplanation:
        """The view a tenant may see: ``different_cache_key`` becomes ``never_seen``
        (true of this request's own key; the other key's owner stays hidden)."""
        if self.reason != "different_cache_key":
            return self
        return CacheMissExplanation(
            "never_seen", self.num_prompt_tokens, self.num_cached_tokens, self.first_miss_block
        )

    def to_dict(self, now: float | None = None) -> dict[str, Any]:
        """Plain data (JSON); ``evicted_s_ago`` instead of the clock reading."""
        d: dict[str, Any] = {
            "reason": self.reason,
            "num_missed_tokens": self.num_missed_tokens,
            "first_miss_block": self.first_miss_block,
        }
        if self.reason == "evicted":
            t = time.monotonic() if now is None else now
            d["tier"] = self.tier
            d["policy"] = self.policy
            ago = None if self.evicted_at is None else max(0.0, t - self.evicted_at)
            d["evicted_s_ago"] = None if ago is None else round(ago, 3)
        if self.reason == "no_state_snapshot":
            d["state_position"] = self.state_position
            d["state_nearest"] = self.state_nearest
            if self.state_refused is not None:
                d["state_refused"] = self.state_refused
            d["message"] = self.message
        return d


class EvictionRecord:
    """The last ``cap`` evictions: block hash -> where, when and why (bounded; a hash
    recorded again counts as new, so the oldest *eviction* is forgotten first).

    Storage is a ring of ``cap`` slots (hash, time, (tier, policy) code) plus a plain
    ``{hash: slot}`` dict: one eviction costs a few list stores and dict operations and
    allocates no tracked object, so the record adds no garbage-collector work however
    full it is (an ``OrderedDict`` of tuples measurably did, docs/benchmarks.md).

    Args:
        cap: most hashes kept (>= 0; 0 = record nothing).

    Attributes:
        num_recorded: evictions recorded so far; num_dropped: records the cap dropped.
    """

    def __init__(self, cap: int = DEFAULT_EVICTION_RECORD_CAP) -> None:
        self.cap = max(0, cap)
        self._slot: dict[bytes, int] = {}
        self._hashes: list[bytes | None] = [None] * self.cap
        self._when = array("d", bytes(8 * self.cap))
        self._what = array("H", bytes(2 * self.cap))
        self._pos = 0
        self._codes: dict[tuple[str, str], int] = {}
        self._names: list[tuple[str, str]] = []
        self.num_recorded = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._slot)

    def code(self, tier: str, policy: str) -> int:
        """A small int standing for ``(tier, policy)`` (for :meth:`record_code`)."""
        key = (tier, policy)
        c = self._codes.get(key)
        if c is None:
            c = self._codes[key] = len(self._names)
            self._names.append(key)
        return c

    def record_eviction(self, block_hash: bytes, tier: str, policy: str, when: float) -> None:
        """Remember that ``block_hash`` left ``tier`` at ``when`` (``time.monotonic()``
        seconds) by ``policy``; a later record of the same hash replaces it. The seam
        every tier reports through."""
        self.record_code(block_hash, self.code(tier, policy), when)

    def record_code(self, block_hash: bytes, code: int, when: float) -> None:
        """:meth:`record_eviction` with a :meth:`code` (the hot path of the pool)."""
        cap = self.cap
        if cap <= 0:
            return
        pos = self._pos
        slot = self._slot
        old = self._hashes[pos]
        if old is not None and slot.get(old) == pos:
            del slot[old]
            self.num_dropped += 1
        self._hashes[pos] = block_hash
        slot[block_hash] = pos
        self._when[pos] = when
        self._what[pos] = code
        self._pos = pos + 1 if pos + 1 < cap else 0
        self.num_recorded += 1

    def forget(self, block_hash: bytes) -> None:
        """Drop the record of ``block_hash`` (e.g. a tier now holds it again)."""
        self._slot.pop(block_hash, None)

    def get(self, block_hash: bytes) -> tuple[str, str, float] | None:
        """``(tier, policy, when)`` of the last recorded eviction, or None."""
        pos = self._slot.get(block_hash)
        if pos is None:
            return None
        tier, policy = self._names[self._what[pos]]
        return tier, policy, self._when[pos]


def aggregate_misses(
    explanations: Iterable[CacheMissExplanation | None],
) -> dict[str, dict[str, float]]:
    """Per reason (in :data:`MISS_REASONS` order, absent reasons left out): requests,
    prompt tokens computed (``missed_tokens``) and their share of all missed tokens."""
    out: dict[str, dict[str, float]] = {}
    for e in explanations:
        if e is None:
            continue
        row = out.setdefault(e.reason, {"requests": 0, "missed_tokens": 0})
        row["requests"] += 1
        row["missed_tokens"] += e.num_missed_tokens
    total = sum(r["missed_tokens"] for r in out.values())
    for r in out.values():
        r["missed_share"] = r["missed_tokens"] / total if total else 0.0
    return {k: out[k] for k in MISS_REASONS if k in out}


def miss_table_rows(agg: dict[str, dict[str, float]]) -> list[tuple[str, str, str, str, str]]:
    """``(reason, requests, missed tokens, share, advice)`` cells of
    :func:`aggregate_misses`, for the replay and simulate tables."""
    return [
        (
            k,
            f"{int(v['requests']):,}",
            f"{int(v['missed_tokens']):,}",
            f"{v['missed_share']:.1%}",
            MISS_ADVICE.get(k, ""),
        )
        for k, v in agg.items()
    ]


def pool_policy(priority: int) -> str:
    """The eviction-policy name of a device-pool block evicted at ``priority``."""
    if priority == PRIORITY_DEFAULT:
        return "lru"
    if priority == PRIORITY_LOW:
        return "lru:low-priority"
    return "lru:retained"


class PoolEvictionRecorder:
    """A ``PoolListener`` that records the pool's evictions (tier ``"device"``).

    Args:
        record: where evictions go.
        priority_of: block id -> its retention priority (read during ``on_evicted``,
            while the block still has it).
        clock: ``time.monotonic`` by default.
    """

    def __init__(
        self,
        record: EvictionRecord,
        priority_of: Callable[[int], int],
        clock: Callable[[], float] = time.monotonic,
        tier: str = "device",
    ) -> None:
        self.record = record
        self._priority_of = priority_of
        self._clock = clock
        self.tier = tier
        #: per priority level, the (tier, policy) code of an eviction at that level
        self._code = [record.code(tier, pool_policy(p)) for p in range(NUM_PRIORITY_LEVELS)]

    def on_stored(self, block_id: int, block_hash: bytes) -> None:
        """Nothing to do: a cached block is a hit, its old record is never consulted."""

    def on_evicted(self, block_id: int, block_hash: bytes) -> None:
        self.record.record_code(block_hash, self._code[self._priority_of(block_id)], self._clock())

    def on_cleared(self) -> None:
        """``reset_prefix_cache``: the manager records those hashes before clearing."""


class KeyRecord:
    """The last ``cap`` distinct encoded cache keys (salt, adapter) seen, LRU."""

    def __init__(self, cap: int = DEFAULT_KEY_RECORD_CAP) -> None:
        self.cap = cap
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        if self.cap <= 0:
            return
        self._keys[key] = None
        self._keys.move_to_end(key)
        if len(self._keys) > self.cap:
            self._keys.popitem(last=False)

    def others(self, key: bytes) -> list[bytes]:
        """Remembered keys other than ``key``, most recent first."""
        return [k for k in reversed(self._keys) if k != key]


class _Cache(Protocol):
    def is_cached(self, block_hash: bytes) -> bool: ...


def explain_first_miss(
    full_pools: Sequence[_Cache],
    has_sliding: bool,
    record: EvictionRecord,
    keys: KeyRecord,
    root: BlockHash,
    extra: bytes,
    token_ids: Sequence[int],
    block_size: int,
    num_cached_tokens: int,
    known_hashes: Sequence[BlockHash],
) -> CacheMissExplanation:
    """The reason of a prefix lookup that hit ``num_cached_tokens`` (see the module
    docstring). No state changes.

    Args:
        full_pools: the full-attention groups' pools (what a hit needs block by block).
        has_sliding: whether the model has sliding-window groups.
        record, keys: the eviction and key records.
        root, extra: the hash chain's root and the request's encoded extra keys.
        token_ids: the prompt.
        block_size: tokens per block.
        num_cached_tokens: the hit taken (a multiple of ``block_size``).
        known_hashes: chained hashes of blocks ``0 ..`` already computed for this
            prompt and key (at least the hit's); more are computed as needed.

    The ``different_cache_key`` check walks each other remembered key's chain from
    block 0 and stops at its first block not cached (at most
    :data:`MAX_CROSS_KEY_BLOCKS` blocks per key).
    """
    n = len(token_ids)
    bs = block_size
    hb = num_cached_tokens // bs
    if (n - 1) // bs == 0:
        return CacheMissExplanation("no_full_block", n, num_cached_tokens)
    if hb >= (n - 1) // bs:
        return CacheMissExplanation("full_hit", n, num_cached_tokens)
    i = hb
    if len(known_hashes) > i:
        h = known_hashes[i]
    else:
        parent = known_hashes[i - 1] if i else root
        h = chain_hash(parent, extra, token_ids[i * bs : (i + 1) * bs])
    if all(p.is_cached(h) for p in full_pools):
        why = "sliding_window" if has_sliding else "hit_not_taken"
        return CacheMissExplanation(why, n, num_cached_tokens, i)
    got = record.get(h)
    if got is not None:
        tier, policy, when = got
        return CacheMissExplanation("evicted", n, num_cached_tokens, i, tier, policy, when)
    if i < MAX_CROSS_KEY_BLOCKS:
        for other in keys.others(extra):
            for j, hk in enumerate(iter_block_hashes(root, other, token_ids, bs, 0, i + 1)):
                if not all(p.is_cached(hk) for p in full_pools):
                    break
                if j == i:
                    return CacheMissExplanation("different_cache_key", n, num_cached_tokens, i)
    return CacheMissExplanation("never_seen", n, num_cached_tokens, i)


__all__ = [
    "MISS_ADVICE",
    "aggregate_misses",
    "explain_first_miss",
    "miss_table_rows",
    "DEFAULT_EVICTION_RECORD_CAP",
    "DEFAULT_KEY_RECORD_CAP",
    "MAX_CROSS_KEY_BLOCKS",
    "MISS_REASONS",
    "CacheMissExplanation",
    "EvictionRecord",
    "KeyRecord",
    "PoolEvictionRecorder",
    "pool_policy",
]
