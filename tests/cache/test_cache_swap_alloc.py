"""Swap preemption's side of the allocator on a unified pool with a sliding group
(``KVCacheManager.swap_blocks``, ``allocate_swapped``, ``fit_new_tokens(...,
num_swapped_tokens=)``): per group only the blocks a continuation needs, null sliding
entries below the window on readmission (as a prefix hit leaves them), never registered
as cached content."""

from __future__ import annotations

import pytest
from cache_helpers import make_spec

from kvpage.cache import KVCacheManager
from kvpage.errors import AllocationError

BS, W = 2, 4


def _computed(mgr: KVCacheManager, rid: str, tokens: list[int], chunk: int) -> None:
    """Allocate, compute and commit ``tokens`` in chunks of ``chunk``."""
    done = 0
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        assert mgr.allocate(rid, tokens, n) is not None
        done += n
        mgr.commit(rid, tokens, done)


def test_swapped_readmission_holds_only_the_window_and_registers_no_stale_block() -> None:
    mgr = KVCacheManager(make_spec(60, BS, (None, W), "unified"), max_alloc_tokens=4)
    toks = list(range(3, 23))  # 20 tokens, 10 blocks
    _computed(mgr, "a", toks, 4)
    lo = (20 - W + 1) // BS  # 8: the sliding group's first block needed at position 20
    out = mgr.swap_blocks("a", 20)
    assert [len(b) for b in out] == [10, 10 - lo]
    assert out[0] == mgr.block_table("a", 0) and out[1] == mgr.block_table("a", 1)[lo:]
    mgr.free("a")
    assert mgr.reset_prefix_cache()  # the originals gone (as if evicted)
    toks.append(99)
    free0 = mgr.num_free_blocks
    assert mgr.fit_new_tokens("a", toks, 1, num_swapped_tokens=20) == 1
    alloc = mgr.allocate_swapped("a", toks, 20, 1)
    assert alloc is not None and alloc.num_cached_tokens == 0
    t1 = mgr.block_table("a", 1)
    assert t1[:lo] == [0] * lo and 0 not in t1[lo:] and len(t1) == 11
    assert free0 - mgr.num_free_blocks == 11 + (11 - lo)
    assert [len(b) for b in mgr.swap_blocks("a", 20)] == [10, 10 - lo]
    mgr.check_integrity()
    mgr.commit("a", toks, 21)  # after the step: blocks 0..9 hashed
    assert len(mgr.pools[0].cached_hashes()) == 10
    held = {mgr.pools[1].cached_block_id(h) for h in mgr.pools[1].cached_hashes()}
    assert held == set(t1[lo:10])  # only the window's blocks, restored by the swap-in
    mgr.check_integrity()
    mgr.free("a")
    assert mgr.num_used_blocks == 0


def test_fit_new_tokens_of_a_swap_in_equals_the_allocator() -> None:
    mgr = KVCacheManager(make_spec(40, BS, (None, W), "unified"), max_alloc_tokens=8)
    toks = list(range(3, 27))  # 24 tokens
    _computed(mgr, "a", toks, 8)
    mgr.free("a")
    filler = list(range(100, 124))
    _computed(mgr, "b", filler, 8)  # holds part of the pool
    toks += [1] * 8
    got = []
    for keep in range(0, 12, 3):
        m = mgr.fit_new_tokens("a", toks, 8, keep_free=keep, num_swapped_tokens=24)
        got.append(m)
        if m < 8:  # one token more does not fit beside keep
            alloc = mgr.allocate_swapped("a", toks, 24, m + 1)
            if alloc is not None:
                assert mgr.num_free_blocks < keep
                mgr.free("a")
        if m:
            assert mgr.allocate_swapped("a", toks, 24, m) is not None
            assert mgr.num_free_blocks >= keep
            mgr.free("a")
        mgr.check_integrity()
    # b holds 12 + 6 blocks of 39; a swap-in of 24 tokens + m takes ceil((24 + m) / 2)
    # full blocks and those minus 10 sliding ones (null below the window)
    assert got == [6, 4, 0, 0]


def test_allocate_swapped_refusals_change_nothing() -> None:
    mgr = KVCacheManager(make_spec(40, BS, (None, W), "unified"), max_alloc_tokens=4)
    toks = list(range(3, 15))
    with pytest.raises(AllocationError, match="num_new_tokens"):
        mgr.allocate_swapped("a", toks, 6, 5)  # above max_alloc_tokens
    with pytest.raises(AllocationError, match="num_swapped_tokens"):
        mgr.allocate_swapped("a", toks, 0, 2)
    with pytest.raises(AllocationError, match="num_swapped_tokens"):
        mgr.allocate_swapped("a", toks, 11, 2)  # past the known tokens
    assert mgr.num_requests == 0 and mgr.num_used_blocks == 0
    assert mgr.allocate_swapped("a", toks, 8, 4) is not None
    with pytest.raises(AllocationError, match="request_id"):
        mgr.allocate_swapped("a", toks, 8, 4)
    with pytest.raises(AllocationError, match="num_tokens"):
        mgr.swap_blocks("a", 13)
    with pytest.raises(AllocationError, match="num_swapped_tokens"):
        mgr.fit_new_tokens("a", toks, 1, num_swapped_tokens=8)  # a later call
    mgr.check_integrity()
