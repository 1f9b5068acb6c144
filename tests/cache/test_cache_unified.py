"""The unified block pool (``CacheSpec.kv_pool="unified"``): one pool under every KV
group, memory flowing to the group that needs it, global LRU eviction, integrity."""

from __future__ import annotations

import pytest
from cache_helpers import make_spec

from kvpage.cache import KVCacheManager
from kvpage.errors import AllocationError, IntegrityError


def _decode(mgr: KVCacheManager, rid: str, tokens: list[int], n: int) -> bool:
    """Allocate, compute and commit ``n`` decode tokens one at a time; False on a failed
    allocation."""
    for _ in range(n):
        tokens.append(len(tokens) % 5)
        if mgr.allocate(rid, tokens, 1) is None:
            return False
        mgr.commit(rid, tokens, len(tokens))
    return True


def test_sliding_blocks_freed_serve_the_full_group() -> None:
    # 1 full + 1 sliding layer (window 2, block 2): a 40-token sequence holds 20 full
    # blocks and ~2 sliding ones. Per-group pools with the same bytes (21 blocks each,
    # 40 usable across both) run out at 40 tokens in the full group; the unified pool
    # (41 blocks) gives the full group what the sliding group released.
    per = KVCacheManager(make_spec(21, 2, (None, 2), "per_group"))
    uni = KVCacheManager(make_spec(41, 2, (None, 2), "unified"))
    assert uni.unified and not per.unified
    results = {}
    for name, mgr in (("per", per), ("uni", uni)):
        toks = [1, 2]
        assert mgr.allocate("r", toks, 2) is not None
        mgr.commit("r", toks, 2)
        results[name] = _decode(mgr, "r", toks, 60)
        mgr.check_integrity()
    assert results == {"per": False, "uni": True}
    assert uni.num_allocated_tokens("r") == 62
    held = uni.used_blocks_by_group()
    assert held == [31, 1] or held == [31, 2]  # full: ceil(62/2); sliding: its window
    assert uni.num_used_blocks == sum(held) and uni.num_free_blocks == 40 - sum(held)
    uni.free("r")
    uni.check_integrity()
    assert uni.num_used_blocks == 0 and uni.num_free_blocks == 40


def test_eviction_is_global_lru_across_groups() -> None:
    mgr = KVCacheManager(make_spec(9, 2, (None, None, 4), "unified"))  # 3 groups of 1
    assert mgr.num_groups == 3  # gcd(2, 1) = 1 layer per group
    a = list(range(4))
    assert mgr.allocate("a", a, 4) is not None  # 2 blocks per group: 6 of 8
    mgr.commit("a", a, 4)
    mgr.free("a")  # every group's 2 blocks cached and free, in one LRU order
    shared = mgr.shared_pool
    assert shared is not None
    order = shared.free_queue.ids()  # head (evicted first) .. tail
    assert len(order) == 8
    t0, t1, t2 = (mgr.pools[g] for g in range(3))
    # each group's own hash map names its own copy of the same 2 hashes
    assert t0.cached_hashes() == t1.cached_hashes() == t2.cached_hashes()
    assert len({p.cached_block_id(h) for p in (t0, t1, t2) for h in t0.cached_hashes()}) == 6
    assert mgr.get_num_cached_tokens(a + [9]) == 4
    # a new 8-token request needs 4 blocks per group = 12 > 8: refused, nothing evicted
    assert mgr.allocate("big", list(range(20, 28)), 8) is None
    assert shared.num_evictions == 0
    # a 4-token unrelated request takes 6 blocks: the 2 empty ones, then the 4 oldest
    # cached ones in the one LRU order (whatever group they belong to)
    expect_evicted = order[2:6]
    assert mgr.allocate("c", list(range(30, 34)), 4) is not None
    assert shared.num_evictions == 4
    assert sum(p.num_evictions for p in (t0, t1, t2)) == 4
    got = [x for t in mgr.block_tables("c") for x in t]
    assert sorted(got) == sorted(order[:6]) and set(expect_evicted) <= set(got)
    mgr.check_integrity()


def test_integrity_catches_a_block_held_for_another_group() -> None:
    mgr = KVCacheManager(make_spec(9, 2, (None, 4), "unified"))
    assert mgr.allocate("a", [1, 2, 3], 3) is not None
    req = mgr._reqs["a"]
    req.tables[1][0], req.tables[0][0] = req.tables[0][0], req.tables[1][0]
    with pytest.raises(IntegrityError, match="held by group"):
        mgr.check_integrity()


def test_fork_cow_and_window_release_on_the_shared_pool() -> None:
    mgr = KVCacheManager(make_spec(30, 2, (None, 3), "unified"))
    toks = [1, 2, 3]
    assert mgr.allocate("p", toks, 3) is not None
    mgr.commit("p", toks, 3)
    mgr.fork("p", "c")
    a = mgr.allocate("c", toks + [4], 1)
    assert a is not None and all(len(c) == 1 for c in a.copies)  # CoW in both groups
    mgr.check_integrity()
    assert _decode(mgr, "c", toks + [4], 10)
    assert mgr.stats.window_blocks_freed > 0
    mgr.free("p")
    mgr.free("c")
    mgr.check_integrity()
    assert mgr.num_used_blocks == 0


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_max_request_tokens_is_reachable_alone_with_the_step_budget(chunk: int) -> None:
    """With ``max_alloc_tokens`` the unified pool's max_request_tokens counts only the
    sliding groups' window (+ one call), and a request of that length, grown in calls
    of at most that many tokens, always fits alone."""
    spec = make_spec(41, 2, (None, 3, 5), "unified")
    mgr = KVCacheManager(spec, max_alloc_tokens=chunk, enable_prefix_caching=False)
    plain = KVCacheManager(spec)
    assert mgr.max_request_tokens > plain.max_request_tokens == 40 // 3 * 2
    n = mgr.max_request_tokens
    done = 0
    while done < n:
        step = min(chunk, n - done)
        assert mgr.allocate("r", range(n), step) is not None, f"failed at {done}"
        done += step
    mgr.check_integrity()
    assert mgr.num_used_blocks <= 40
    # a call above the budget the bound relies on is refused by name
    with pytest.raises(AllocationError, match="max_alloc_tokens"):
        mgr.allocate("r", range(n + chunk + 1), chunk + 1)
