"""Retention controls of the block pool and manager: priority-then-LRU eviction, TTL
expiry, the retention cap, admission of a max-length request, tenant isolation."""

from __future__ import annotations

import pytest
from cache_helpers import make_spec

from kvpage.cache import (
    PRIORITY_DEFAULT,
    PRIORITY_HIGH,
    PRIORITY_LOW,
    PRIORITY_MAX,
    BlockPool,
    KVCacheManager,
    KVRetention,
    RetentionRange,
    max_retained_blocks,
)
from kvpage.errors import AllocationError, SpecError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def serve(
    mgr: KVCacheManager,
    rid: str,
    prompt: list[int],
    *,
    salt: str | None = None,
    retention: KVRetention | None = None,
    generated: list[int] = (),  # type: ignore[assignment]
) -> int:
    """Admit, prefill, decode ``generated``, commit and free one request; returns the hit."""
    toks = list(prompt)
    hit = mgr.get_num_cached_tokens(toks, cache_salt=salt)
    assert mgr.allocate(rid, toks, len(toks) - hit, num_cached_tokens=hit, cache_salt=salt)
    if retention is not None:
        mgr.set_retention(rid, retention, len(prompt))
    mgr.commit(rid, toks, len(toks))
    for t in generated:
        toks.append(t)
        assert mgr.allocate(rid, toks, 1) is not None
        mgr.commit(rid, toks, len(toks))
    mgr.free(rid)
    mgr.check_integrity()
    return hit


def cached_pool(levels: list[int]) -> BlockPool:
    """A pool whose blocks 1..k are cached and free, block i at priority levels[i-1]."""
    pool = BlockPool(len(levels) + 1, max_retained_blocks=len(levels))
    blocks = pool.allocate(len(levels))
    for b, lvl in zip(blocks, levels):
        pool.cache_block(b, bytes([b.block_id]) * 32)
        pool.set_retention([b.block_id], lvl, None)
    pool.free(blocks)
    pool.check_integrity()
    return pool


def test_eviction_goes_by_priority_then_lru() -> None:
    pool = cached_pool([PRIORITY_MAX, PRIORITY_DEFAULT, PRIORITY_LOW, PRIORITY_HIGH, 1, 0])
    # level 0 in LRU order (3, 6), then level 1 (2, 5), then 2 (4), then 3 (1)
    assert pool.free_queue.ids() == [3, 6, 2, 5, 4, 1]
    assert [pool.allocate(1)[0].block_id for _ in range(6)] == [3, 6, 2, 5, 4, 1]
    assert pool.num_evictions == 6 and not pool.cached
    assert all(pool.priority_of(i) == PRIORITY_DEFAULT for i in range(1, 7))


def test_empty_blocks_are_reused_before_any_cached_block() -> None:
    pool = cached_pool([PRIORITY_LOW, PRIORITY_DEFAULT])
    (b,) = pool.allocate(1)  # evicts block 1 (low)
    pool.free([b])  # empty now: head of level 0
    assert pool.free_queue.ids() == [1, 2]


def test_set_retention_merges_raise_and_keeps_others_retention() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.set_retention([b.block_id], PRIORITY_HIGH, 5.0)
    pool.set_retention([b.block_id], PRIORITY_LOW, None)  # a lowering cannot undo a raise
    assert pool.priority_of(b.block_id) == PRIORITY_HIGH
    pool.set_retention([b.block_id], PRIORITY_MAX, 2.0)
    assert pool.priority_of(b.block_id) == PRIORITY_MAX and b.ttl == 5.0
    with pytest.raises(AllocationError, match="priority: expected an int in"):
        pool.set_retention([b.block_id], 4, None)


def test_ttl_expiry_is_lazy_and_moves_the_block_to_the_default_head() -> None:
    clock = Clock()
    pool = BlockPool(5, clock=clock, max_retained_blocks=4)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i + 1]) * 32)
    pool.set_retention([blocks[0].block_id], PRIORITY_MAX, 10.0)
    pool.free(blocks)
    assert pool.num_retained == 1
    assert pool.free_queue.ids() == [4, 2, 3, 1]
    clock.t += 10.5
    assert pool.num_retained == 1  # lazy: nothing moved until the pool looks
    (got,) = pool.allocate(1)  # the allocation applies the expiry first
    assert got.block_id == 4 and pool.num_retained == 0
    assert pool.free_queue.ids() == [1, 2, 3]  # expired block first among the default ones
    pool.check_integrity()


def test_reviving_a_retained_block_makes_its_deadline_stale() -> None:
    clock = Clock()
    pool = BlockPool(3, clock=clock)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"\x01" * 32)
    pool.set_retention([b.block_id], PRIORITY_HIGH, 1.0)
    pool.free([b])
    pool.touch([b])  # a prefix hit takes it back
    clock.t += 5
    assert pool.expire() == 0  # the stale entry is skipped
    pool.free([b])  # freed again: a new deadline, 1 s from now
    assert pool.num_retained == 1 and pool.expire() == 0
    clock.t += 1.5
    assert pool.expire() == 1 and pool.num_retained == 0
    pool.check_integrity()


def test_the_cap_turns_extra_retention_into_default_priority() -> None:
    pool = BlockPool(6, max_retained_blocks=2)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i + 1]) * 32)
    pool.set_retention([b.block_id for b in blocks], PRIORITY_MAX, None)
    pool.free(blocks)
    assert pool.num_retained == 2 and pool.num_retention_refused == 1
    pool.check_integrity()
    with pytest.raises(AllocationError, match="max_retained_blocks"):
        BlockPool(6, max_retained_blocks=6)


def test_reset_prefix_cache_drops_retention() -> None:
    pool = cached_pool([PRIORITY_MAX, PRIORITY_HIGH, PRIORITY_LOW])
    assert pool.reset_prefix_cache()
    assert pool.num_retained == 0 and pool.free_queue.ids() == [3, 2, 1]  # eviction order kept
    pool.check_integrity()


SYSTEM = list(range(100, 116))  # 16 tokens = 4 blocks of 4


def test_pinned_system_prompt_survives_a_flood_until_its_ttl() -> None:
    clock = Clock()
    mgr = KVCacheManager(make_spec(17, 4), clock=clock, max_retained_blocks=4)
    pin = KVRetention((RetentionRange(0, 16, PRIORITY_MAX, 60.0),))
    assert serve(mgr, "sys", SYSTEM + [1, 2, 3], retention=pin) == 0
    assert mgr.num_retained_blocks == 4
    # a flood: 40 requests of 12 distinct tokens each, 3x the pool's size in total
    for i in range(40):
        serve(mgr, f"f{i}", [1000 + 12 * i + j for j in range(12)], generated=[7, 7])
        clock.t += 1.0  # 40 s pass: the pin holds
    assert mgr.get_num_cached_tokens(SYSTEM + [5, 6]) == 16
    clock.t += 21.0  # 61 s after the pin was freed: expired, plain LRU from here
    for i in range(40, 44):
        serve(mgr, f"f{i}", [1000 + 12 * i + j for j in range(12)])
    assert mgr.num_retained_blocks == 0
    prompt = SYSTEM + [5, 6]
    hit = mgr.get_num_cached_tokens(prompt)
    assert hit == 0
    why = mgr.explain_miss(prompt, hit)
    assert (why.reason, why.tier, why.policy, why.first_miss_block) == (
        "evicted",
        "device",
        "lru",
        0,
    )
    assert why.evicted_at is not None and why.evicted_at >= 1061.0


def test_without_a_pin_the_flood_evicts_the_system_prompt() -> None:
    mgr = KVCacheManager(make_spec(17, 4))
    serve(mgr, "sys", SYSTEM + [1, 2, 3])
    for i in range(10):
        serve(mgr, f"f{i}", [1000 + 12 * i + j for j in range(12)])
    assert mgr.get_num_cached_tokens(SYSTEM + [5, 6]) == 0


def test_decode_blocks_at_low_priority_go_first() -> None:
    mgr = KVCacheManager(make_spec(12, 4))
    low = KVRetention(decode_priority=PRIORITY_LOW)
    serve(mgr, "a", list(range(8)), retention=low, generated=list(range(8, 16)))
    serve(mgr, "b", list(range(50, 62)))  # default priority, freed later (newer LRU)
    # a's decode blocks (2, 3: tokens 8..15) sit in level 0, behind the 4 empty blocks
    # and before b's blocks (freed later) and a's prompt blocks
    assert len(mgr.pools[0].cached) == 7 and mgr.pools[0].num_free == 11
    # allocate 6 blocks: the 4 empty ones, then the two low decode blocks
    assert mgr.allocate("c", list(range(200, 224)), 24) is not None
    assert mgr.get_num_cached_tokens(list(range(16)) + [1]) == 8
    assert mgr.get_num_cached_tokens(list(range(50, 62)) + [1]) == 12


def test_pins_never_push_admission_below_one_max_length_request() -> None:
    num_blocks, bs, max_len = 13, 4, 32  # 12 usable blocks, 8 for a max-length request
    cap = max_retained_blocks(num_blocks - 1, 0.9, -(-max_len // bs))
    assert cap == 4
    mgr = KVCacheManager(make_spec(num_blocks, bs), max_retained_blocks=cap)
    pin = KVRetention((RetentionRange(0, None, PRIORITY_MAX, None),))
    for i in range(4):  # 4 tenants pin 2 blocks each: 8 asked, 4 granted
        serve(mgr, f"p{i}", [500 + 8 * i + j for j in range(9)], salt=f"t{i}", retention=pin)
    assert mgr.num_retained_blocks == cap
    retained = {h for h, b in mgr.pools[0].cached.items() if b.priority > PRIORITY_DEFAULT}
    # a max-length request fits without evicting a retained block
    prompt = list(range(max_len))
    assert mgr.allocate("big", prompt, max_len) is not None
    assert retained <= set(mgr.pools[0].cached)
    mgr.free("big")
    with pytest.raises(SpecError, match="kv_retention_max_share"):
        max_retained_blocks(12, 1.5, 1)


def test_a_pinned_block_of_one_tenant_is_not_served_to_another() -> None:
    mgr = KVCacheManager(make_spec(17, 4))
    pin = KVRetention((RetentionRange(0, 16, PRIORITY_MAX, None),))
    assert mgr.explain_miss(SYSTEM + [1], 0, cache_salt="t:A").reason == "never_seen"
    serve(mgr, "a", SYSTEM + [1], salt="t:A", retention=pin)  # key t:A now remembered
    assert mgr.num_retained_blocks == 4
    prompt = SYSTEM + [2]
    assert mgr.get_num_cached_tokens(prompt, cache_salt="t:A") == 16
    hit = mgr.get_num_cached_tokens(prompt, cache_salt="t:B")
    assert hit == 0
    why = mgr.explain_miss(prompt, hit, cache_salt="t:B")
    assert why.reason == "different_cache_key"  # the operator's view
    assert why.public().reason == "never_seen"  # what tenant B may be told


def test_retention_policy_validation_names_the_field() -> None:
    with pytest.raises(SpecError, match=r"kv_retention.ranges\[0\].priority: expected an int"):
        KVRetention.from_dict({"ranges": [{"start": 0, "end": 8, "priority": 9}]})
    with pytest.raises(SpecError, match=r"kv_retention.ranges\[0\].end: expected None or"):
        KVRetention.from_dict({"ranges": [{"start": 4, "end": 4}]})
    with pytest.raises(SpecError, match=r"kv_retention.decode_ttl_s"):
        KVRetention.from_dict({"decode_ttl_s": -1})
    with pytest.raises(SpecError, match=r"kv_retention: expected keys among"):
        KVRetention.from_dict({"ttl": 3})
    with pytest.raises(SpecError, match=r"kv_retention.ranges\[0\]: expected keys among"):
        KVRetention.from_dict({"ranges": [{"first": 3}]})
    r = KVRetention.from_dict(
        {"ranges": [{"start": 0, "end": 16, "priority": 3, "ttl_s": 30}], "decode_priority": 0}
    )
    assert KVRetention.from_dict(r.to_dict()) == r
    assert r.block_spans(20, 4, 7) == [(0, 4, 3, 30.0), (5, 7, 0, None)]
    # only blocks wholly inside the range: tokens 2..9 cover block 1 (4..7) alone
    assert KVRetention((RetentionRange(2, 10, 3, None),)).block_spans(20, 4, 5) == [(1, 2, 3, None)]


def test_blocks_a_sliding_window_releases_keep_the_policy() -> None:
    mgr = KVCacheManager(make_spec(40, 4, windows=(None, 8)))
    pin = KVRetention((RetentionRange(0, 16, PRIORITY_MAX, None),))
    toks = SYSTEM + [1, 2, 3, 4]
    assert mgr.allocate("a", toks, 12) is not None  # chunked prefill: 12, then 8
    mgr.set_retention("a", pin, len(toks))
    mgr.commit("a", toks, 12)
    assert mgr.allocate("a", toks, 8) is not None  # the window (8) releases block 0
    sliding = mgr.pools[1]
    released = [b for b in sliding.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None]
    assert released and all(b.priority == PRIORITY_MAX for b in released)
    assert sliding.num_retained == len(released)
    mgr.free("a")
    mgr.check_integrity()
