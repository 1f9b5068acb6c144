"""KVCacheManager at the edges of its rules: constructor refusals, the one-request
limit (``max_request_tokens``) against its documented formula, exact fits of a unified
pool, the boundaries of ``allocate``/``commit``/``truncate``, the state methods of a
manager without state layers and the hybrid refusals and reset. Written for the survivors
of the mutation runs of ``cache/manager.py`` (docs/mutation-testing.md)."""

from __future__ import annotations

import pytest
from cache_helpers import make_spec
from test_state_pool import _run_prefill, make_manager

from kvpage.cache import KVCacheManager
from kvpage.errors import AllocationError, SpecError


def test_constructor_refusals_and_smallest_accepted_values() -> None:
    with pytest.raises(SpecError, match=r"^max_alloc_tokens: expected None or >= 1, got 0$"):
        KVCacheManager(make_spec(4, 4), max_alloc_tokens=0)
    assert KVCacheManager(make_spec(4, 4), max_alloc_tokens=1).max_alloc_tokens == 1
    with pytest.raises(
        SpecError, match=r"^spec.num_blocks: expected >= 2 \(block 0 is the null block\), got 1$"
    ):
        KVCacheManager(make_spec(1, 4))
    m = KVCacheManager(make_spec(2, 4))  # one usable block
    assert m.max_request_tokens == 4 and m.allocate("a", [1] * 4, 4) is not None


def test_one_group_is_never_unified() -> None:
    m = KVCacheManager(make_spec(9, 4, (None,), "unified"))
    assert not m.unified and m.shared_pool is None
    assert KVCacheManager(make_spec(9, 4, (None, 8), "unified")).unified


def _formula(num_blocks: int, bs: int, windows: list[int | None], c: int) -> int:
    """max_request_tokens as the class docstring states it, by a linear scan over T."""
    usable = num_blocks - 1
    caps = [-(-(w + c - 1) // bs) + 1 for w in windows if w is not None]
    nfull = sum(w is None for w in windows)
    if nfull == 0 and sum(caps) <= usable:
        return 2**40
    best = 0
    for nb in range(1, usable + 1):
        if nfull * nb + sum(min(nb, k) for k in caps) <= usable:
            best = nb
    return best * bs


@pytest.mark.parametrize(
    ("num_blocks", "windows", "c"),
    [
        (9, [None, 8], 4),
        (3, [None, 8], 4),  # a sliding group's cap above the pool: nothing past 1 block
        (2, [None, 8], 4),  # not even one block for both groups
        (10, [8, 12], 4),  # windows only, exactly fitting: any length
        (9, [8, 12], 4),  # windows only, one block short
        (40, [None, None, 16, 4], 8),
    ],
)
def test_max_request_tokens_matches_its_formula(
    num_blocks: int, windows: list[int | None], c: int
) -> None:
    m = KVCacheManager(make_spec(num_blocks, 4, windows, "unified"), max_alloc_tokens=c)
    assert m.max_request_tokens == _formula(num_blocks, 4, windows, c)


def test_max_request_tokens_without_a_token_cap() -> None:
    assert KVCacheManager(make_spec(9, 4)).max_request_tokens == 8 * 4
    assert KVCacheManager(make_spec(9, 4, (None, 8))).max_request_tokens == 8 * 4  # per group
    assert KVCacheManager(make_spec(9, 4, (None, 8), "unified")).max_request_tokens == 4 * 4


def test_unified_pool_takes_its_last_free_blocks() -> None:
    m = KVCacheManager(make_spec(5, 4, (None, 8), "unified"))  # 4 usable blocks, 2 groups
    assert m.allocate("a", [1] * 4, 4) is not None  # 1 block per group: 2 left
    assert m.allocate("b", [2] * 4, 4) is not None  # exactly the 2 left
    assert m.num_free_blocks == 0
    m.free("b")
    assert m.allocate("a", [1] * 8, 4) is not None  # growth taking exactly the 2 left
    assert m.num_free_blocks == 0 and m.allocate("a", [1] * 12, 4) is None


def test_later_allocate_accepts_zero_and_refuses_negative() -> None:
    m = KVCacheManager(make_spec(9, 4))
    m.allocate("a", [1] * 3, 3)
    got = m.allocate("a", [1] * 3, 0)
    assert got is not None and got.new_blocks == [[]]
    with pytest.raises(AllocationError, match=r"^num_new_tokens: expected >= 0, got -1$"):
        m.allocate("a", [1] * 3, -1)


def test_prefix_hits_count_one_per_hit_request() -> None:
    m = KVCacheManager(make_spec(9, 4))
    toks = list(range(9))
    m.allocate("a", toks, 9)
    m.commit("a", toks, 9)
    hit = m.get_num_cached_tokens(toks)
    assert hit == 8
    m.allocate("b", toks, 1, num_cached_tokens=hit)
    m.allocate("c", [50] * 5, 5)  # no hit
    assert m.stats.prefix_hits == 1 and m.stats.prefix_queries == 3


def test_commit_refuses_more_than_the_known_tokens() -> None:
    m = KVCacheManager(make_spec(9, 4))
    m.allocate("a", [1] * 8, 8)
    with pytest.raises(AllocationError, match=r"len\(token_ids\)=4\), got 8$"):
        m.commit("a", [1] * 4, 8)  # allocated 8, but only 4 tokens given


def test_truncate_accepts_both_ends_of_its_range() -> None:
    m = KVCacheManager(make_spec(9, 4))
    toks = list(range(10))
    m.allocate("a", toks, 10)
    m.commit("a", toks, 4)  # one committed block: range [4, 10]
    m.truncate("a", 10)  # the allocated end: no change
    assert m.num_allocated_tokens("a") == 10 and len(m.block_table("a")) == 3
    m.truncate("a", 4)  # the committed end
    assert m.num_allocated_tokens("a") == 4 and len(m.block_table("a")) == 1
    with pytest.raises(AllocationError, match=r"^num_tokens: expected in \[4, 4\]"):
        m.truncate("a", 3)


def test_state_methods_of_a_manager_without_state_layers() -> None:
    dense = KVCacheManager(make_spec(9, 4))
    with pytest.raises(
        AllocationError, match=r"^state_slot: expected a model with state layers, got none$"
    ):
        dense.state_slot("a")
    # no state layers: a chunk may end anywhere (the request need not be allocated)
    assert dense.state_chunk_end("a", [1] * 12, 0, 12) == 12
    assert dense.state_chunk_end("a", [1] * 12, 3, 4) == 4


def test_hybrid_reset_prefix_cache_waits_for_the_last_request() -> None:
    m = make_manager()
    a = list(range(200, 270))
    _run_prefill(m, "a", a)
    assert m.reset_prefix_cache() is False  # "a" holds blocks and a live state slot
    m.free("a")
    assert m.get_num_cached_tokens(a) > 0
    assert m.reset_prefix_cache() is True
    assert m.get_num_cached_tokens(a) == 0
    m.check_integrity()


def test_hybrid_allocate_refuses_a_kv_hit_without_its_state_snapshot() -> None:
    m = make_manager(threshold=5)
    a = list(range(200, 270))  # 70 tokens: a snapshot at 64 only
    _run_prefill(m, "a", a)
    m.free("a")
    b = a[:50] + [9] * 30  # 48 tokens of KV in the cache, no snapshot at 48
    with pytest.raises(
        AllocationError,
        match=r"^num_cached_tokens: expected a state snapshot at position 48, got none ",
    ):
        m.allocate("b", b, len(b) - 48, num_cached_tokens=48)
    assert not m.has_request("b")  # the refusal left nothing behind
    m.check_integrity()


def test_allocations_are_counted_one_per_request() -> None:
    m = KVCacheManager(make_spec(9, 4))
    assert m.allocate("a", [1] * 8, 8) is not None
    assert m.stats.allocations == 1
    assert m.allocate("b", [2] * 4, 4) is not None
    assert m.stats.allocations == 2 and m.stats.blocks_allocated == 3
