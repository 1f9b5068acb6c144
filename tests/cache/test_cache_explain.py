"""Cache-miss explanations on a real KVCacheManager: one test per reason, the bounded
eviction record, and the record seam lower tiers report through."""

from __future__ import annotations

import pytest
from cache_helpers import make_spec
from test_cache_retention import Clock, serve

from kvpage.cache import EvictionRecord, KVCacheManager, hash_request_blocks


def test_prompt_without_a_full_block_is_not_a_full_hit() -> None:
    # 4-token blocks: a prompt of at most 4 tokens has no block before its last token
    mgr = KVCacheManager(make_spec(16, 4))
    for prompt in ([1], [1, 2, 3, 4]):
        serve(mgr, f"r{len(prompt)}", prompt)
        why = mgr.explain_miss(prompt, mgr.get_num_cached_tokens(prompt))
        assert (why.reason, why.first_miss_block, why.num_cached_tokens) == (
            "no_full_block",
            None,
            0,
        )
    five = [1, 2, 3, 4, 5]  # one full block, now cached by the 4-token prompt's request
    why = mgr.explain_miss(five, mgr.get_num_cached_tokens(five))
    assert why.reason == "full_hit" and why.num_cached_tokens == 4


def test_never_seen_and_full_hit() -> None:
    mgr = KVCacheManager(make_spec(16, 4))
    prompt = list(range(10))
    why = mgr.explain_miss(prompt, mgr.get_num_cached_tokens(prompt))
    assert (why.reason, why.first_miss_block, why.num_missed_tokens) == ("never_seen", 0, 10)
    serve(mgr, "a", prompt)
    hit = mgr.get_num_cached_tokens(prompt)
    assert hit == 8
    why = mgr.explain_miss(prompt, hit)
    # 2 full blocks hit; the partial block (tokens 8, 9) is never cached
    assert (why.reason, why.first_miss_block, why.num_missed_tokens) == ("full_hit", None, 2)
    longer = prompt[:8] + [99] * 6
    why = mgr.explain_miss(longer, mgr.get_num_cached_tokens(longer))
    assert (why.reason, why.first_miss_block, why.num_cached_tokens) == ("never_seen", 2, 8)


def test_evicted_names_tier_policy_and_time() -> None:
    clock = Clock()
    mgr = KVCacheManager(make_spec(5, 4), clock=clock)  # 4 usable blocks
    prompt = list(range(9))
    serve(mgr, "a", prompt)
    clock.t = 1234.0
    serve(mgr, "b", list(range(100, 116)))  # needs all 4 blocks: evicts a's 2
    hit = mgr.get_num_cached_tokens(prompt)
    why = mgr.explain_miss(prompt, hit)
    assert (why.reason, why.tier, why.policy, why.evicted_at) == (
        "evicted",
        "device",
        "lru",
        1234.0,
    )
    d = why.to_dict(now=1240.0)
    assert d == {
        "reason": "evicted",
        "num_missed_tokens": 9,
        "first_miss_block": 0,
        "tier": "device",
        "policy": "lru",
        "evicted_s_ago": 6.0,
    }


def test_a_lower_tier_reports_through_record_eviction() -> None:
    mgr = KVCacheManager(make_spec(8, 4))
    prompt = list(range(9))
    h0 = hash_request_blocks(prompt, 4)[0]
    mgr.eviction_record.record_eviction(h0, "host", "lru", 5.0)
    why = mgr.explain_miss(prompt, 0)
    assert (why.reason, why.tier, why.evicted_at) == ("evicted", "host", 5.0)


def test_reset_prefix_cache_is_recorded_as_an_eviction() -> None:
    mgr = KVCacheManager(make_spec(8, 4))
    prompt = list(range(9))
    serve(mgr, "a", prompt)
    assert mgr.reset_prefix_cache()
    why = mgr.explain_miss(prompt, mgr.get_num_cached_tokens(prompt))
    assert (why.reason, why.policy) == ("evicted", "reset")


@pytest.mark.parametrize("kv_pool", ["per_group", "unified"])
def test_sliding_window_group_that_cannot_serve_the_hit(kv_pool: str) -> None:
    nb = 32 if kv_pool == "per_group" else 63  # the same bytes
    mgr = KVCacheManager(make_spec(nb, 2, windows=(None, 4), kv_pool=kv_pool))
    assert mgr.unified is (kv_pool == "unified")
    prompt = list(range(10))
    serve(mgr, "a", prompt)
    sliding = mgr.pools[1]
    key = hash_request_blocks(prompt, 2)[3]
    blk = sliding.cached[key]
    sliding.free_queue.remove(blk)
    sliding.free_queue.appendleft(blk)
    sliding.allocate(1)  # evicts block 3 from the sliding group only
    hit = mgr.get_num_cached_tokens(prompt)
    assert hit == 6
    why = mgr.explain_miss(prompt, hit)
    assert (why.reason, why.first_miss_block) == ("sliding_window", 3)


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(make_spec(8, 4), enable_prefix_caching=False)
    assert mgr.explain_miss(list(range(9)), 0).reason == "prefix_caching_disabled"


def test_eviction_record_is_bounded_lru() -> None:
    rec = EvictionRecord(cap=2)
    for i in range(3):
        rec.record_eviction(bytes([i]) * 32, "device", "lru", float(i))
    assert len(rec) == 2 and rec.num_dropped == 1 and rec.num_recorded == 3
    assert rec.get(bytes([0]) * 32) is None and rec.get(bytes([2]) * 32) == ("device", "lru", 2.0)
    rec.record_eviction(bytes([1]) * 32, "host", "lru", 9.0)  # refreshed: now the newest
    rec.record_eviction(bytes([3]) * 32, "device", "lru", 10.0)
    assert rec.get(bytes([2]) * 32) is None and rec.get(bytes([1]) * 32) == ("host", "lru", 9.0)
    assert len(EvictionRecord(cap=0)) == 0


def test_a_shorter_hit_than_cached_is_not_blamed_on_a_window() -> None:
    mgr = KVCacheManager(make_spec(16, 4))
    prompt = list(range(13))
    serve(mgr, "a", prompt)
    assert mgr.get_num_cached_tokens(prompt) == 12
    why = mgr.explain_miss(prompt, 4)  # the caller took 1 of the 3 cached blocks
    assert (why.reason, why.first_miss_block) == ("hit_not_taken", 1)


def test_different_key_needs_the_other_keys_chain_up_to_the_missing_block() -> None:
    mgr = KVCacheManager(make_spec(32, 4))
    system = list(range(100, 116))  # 4 blocks
    for salt in ("t:A", "t:B"):
        mgr.explain_miss(system + [1], 0, cache_salt=salt)  # keys remembered
        serve(mgr, salt, system + [1], salt=salt)
    mine = system + [7, 7, 7, 7, 1]  # tenant B: 4 blocks hit, block 4 is new
    hit = mgr.get_num_cached_tokens(mine, cache_salt="t:B")
    assert hit == 16
    # A holds blocks 0..3 of the same tokens, but not block 4: not a cross-key hit
    assert mgr.explain_miss(mine, hit, cache_salt="t:B").reason == "never_seen"
    serve(mgr, "a2", mine, salt="t:A")  # now A holds block 4 too
    hit = mgr.get_num_cached_tokens(mine, cache_salt="t:B")
    why = mgr.explain_miss(mine, hit, cache_salt="t:B")
    assert (why.reason, why.first_miss_block) == ("different_cache_key", 4)
