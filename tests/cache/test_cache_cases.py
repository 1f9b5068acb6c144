"""Edge cases C01-C07 and C10 (freeing part) of shared/cases/README.md, at the
KVCacheManager / BlockPool level."""

from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import make_spec, snapshot

from kvpage.cache import BlockPool, KVCacheManager, hash_request_blocks, slot_mapping
from kvpage.errors import AllocationError


def run_request(
    mgr: KVCacheManager, rid: str, prompt: list[int], num_generated: int, *, chunk: int = 10**9
) -> tuple[int, list[int]]:
    """Drive one request like the engine would: prefix lookup, chunked prefill, decode
    (allocate -> step writes -> commit), then free. Returns (hit tokens, tokens)."""
    toks = list(prompt)
    hit = mgr.get_num_cached_tokens(toks)
    n = min(chunk, len(toks) - hit)
    alloc = mgr.allocate(rid, toks, n, num_cached_tokens=hit)
    assert alloc is not None and alloc.num_cached_tokens == hit
    done = hit + n
    mgr.commit(rid, toks, done)
    while done < len(toks):
        n = min(chunk, len(toks) - done)
        assert mgr.allocate(rid, toks, n) is not None
        done += n
        mgr.commit(rid, toks, done)
    for i in range(num_generated):
        toks.append(1000 + i)
        if i < num_generated - 1:  # the last sampled token's KV is never computed
            assert mgr.allocate(rid, toks, 1) is not None
            done += 1
            mgr.commit(rid, toks, done)
    mgr.free(rid)
    return hit, toks


# ---- C01 ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("seq_len", "n_blocks", "in_last"),
    [(0, 0, 0), (1, 1, 1), (3, 1, 3), (4, 1, 4), (5, 2, 1), (8, 2, 4)],
)
def test_c01_boundary_arithmetic(seq_len: int, n_blocks: int, in_last: int) -> None:
    mgr = KVCacheManager(make_spec(9, 4))
    assert mgr.blocks_needed(seq_len) == n_blocks
    if seq_len:
        assert mgr.allocate("r", list(range(seq_len)), seq_len) is not None
        table = mgr.block_table("r")
        assert len(table) == n_blocks
        assert mgr.num_allocated_tokens("r") == seq_len
        assert seq_len - (len(table) - 1) * 4 == in_last
        for b in table:
            assert mgr.pools[0].blocks[b].ref_cnt == 1  # fresh block: ref count 1
        mgr.check_integrity()


def test_c01_token_7_slot_and_free_returns_blocks() -> None:
    mgr = KVCacheManager(make_spec(9, 4))
    free_before = mgr.num_free_blocks
    assert mgr.allocate("r", list(range(8)), 8) is not None
    table = mgr.block_table("r")
    assert slot_mapping(table, 7, 1, 4).tolist() == [table[1] * 4 + 3]
    mgr.free("r")
    pool = mgr.pools[0]
    assert mgr.num_free_blocks == free_before
    assert all(pool.blocks[b].ref_cnt == 0 for b in table)
    assert set(table) <= set(pool.free_queue.ids())
    mgr.check_integrity()


# ---- C02 ------------------------------------------------------------------------------
def test_c02_no_double_free_pool() -> None:
    pool = BlockPool(5)  # 4 usable blocks + the null block
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AllocationError, match="double free"):
        pool.free([b])
    ids = pool.free_queue.ids()
    assert len(ids) == 4 and len(set(ids)) == 4
    (c,) = pool.allocate(1)
    with pytest.raises(AllocationError):
        pool.free([c, c])
    assert c.ref_cnt == 1  # the failed free changed nothing
    pool.free([c])
    got = pool.allocate(4)
    assert len({x.block_id for x in got}) == 4 and 0 not in {x.block_id for x in got}
    with pytest.raises(AllocationError):
        pool.free([pool.null_block])
    pool.check_integrity()


def test_c02_no_double_free_manager() -> None:
    mgr = KVCacheManager(make_spec(5, 4))
    assert mgr.allocate("r", [1, 2, 3], 3) is not None
    mgr.free("r")
    with pytest.raises(AllocationError, match="request_id"):
        mgr.free("r")
    ids = mgr.pools[0].free_queue.ids()
    assert sorted(ids) == [1, 2, 3, 4]
    mgr.check_integrity()


# ---- C03 ------------------------------------------------------------------------------
def test_c03_usage_never_exceeds_one_and_cached_blocks_count_free() -> None:
    mgr = KVCacheManager(make_spec(9, 16))  # 8 usable blocks
    prompts = [[p * 100 + i for i in range(40)] for p in range(5)]
    for k in range(20):
        run_request(mgr, f"r{k}", prompts[k // 4], 8)  # each prompt 4x in a row
        assert 0.0 <= mgr.usage <= 1.0
        assert mgr.pools[0].num_used == 0
        assert mgr.usage == 0.0
        assert mgr.num_free_blocks == 8
        mgr.check_integrity()
    assert mgr.stats.prefix_hits_tokens > 0
    assert len(mgr.pools[0].cached) > 0
    big = list(range(5000, 5128))  # needs all 8 blocks
    assert mgr.allocate("big", big, 128) is not None
    assert mgr.usage == 1.0
    assert len(mgr.pools[0].cached) == 0 and mgr.stats.evictions > 0
    mgr.check_integrity()


# ---- C04 ------------------------------------------------------------------------------
def test_c04_hit_only_after_kv_written() -> None:
    mgr = KVCacheManager(make_spec(32, 16))
    prompt = list(range(40))
    # two identical requests scheduled in the same step
    h1 = mgr.get_num_cached_tokens(prompt)
    assert mgr.allocate("a", prompt, 40, num_cached_tokens=h1) is not None
    h2 = mgr.get_num_cached_tokens(prompt)
    assert (h1, h2) == (0, 0)
    assert mgr.allocate("b", prompt, 40, num_cached_tokens=h2) is not None
    with pytest.raises(AllocationError):  # claiming a hit that is not written yet
        mgr.allocate("x", prompt, 8, num_cached_tokens=16)
    # the step ran
    mgr.commit("a", prompt, 40)
    mgr.commit("b", prompt, 40)
    assert mgr.get_num_cached_tokens(prompt) == 32
    a = mgr.allocate("c", prompt, 8, num_cached_tokens=32)
    assert a is not None and a.num_cached_tokens == 32
    assert mgr.block_table("c")[:2] == mgr.block_table("a")[:2]
    mgr.check_integrity()


def test_c04_aborted_before_step_never_findable() -> None:
    mgr = KVCacheManager(make_spec(32, 16))
    prompt = list(range(7, 47))
    assert mgr.allocate("a", prompt, 40) is not None
    mgr.free("a")  # aborted before its step ran: never committed
    assert mgr.get_num_cached_tokens(prompt) == 0
    assert mgr.pools[0].cached == {}
    mgr.check_integrity()


# ---- C05 ------------------------------------------------------------------------------
def test_c05_fully_cached_prompt_still_computes_one_token() -> None:
    mgr = KVCacheManager(make_spec(32, 16))
    prompt = list(range(32))
    assert run_request(mgr, "r1", prompt, 4)[0] == 0
    assert mgr.get_num_cached_tokens(prompt) == 16  # never 32
    with pytest.raises(AllocationError, match="num_cached_tokens"):
        mgr.allocate("bad", prompt, 1, num_cached_tokens=32)
    with pytest.raises(AllocationError, match="num_new_tokens"):
        mgr.allocate("bad", prompt, 0, num_cached_tokens=16)  # zero-length prefill
    assert run_request(mgr, "r2", prompt, 4)[0] == 16
    assert run_request(mgr, "r3", prompt, 4)[0] == 16  # the chain is intact
    assert mgr.get_num_cached_tokens(list(range(33))) == 32  # control
    s = mgr.stats
    assert (s.prefix_queries, s.prefix_hits, s.prefix_hits_tokens) == (3, 2, 32)
    assert s.prefix_queries_tokens == 96
    mgr.check_integrity()


def test_c05_hit_is_contiguous_from_block_zero() -> None:
    mgr = KVCacheManager(make_spec(32, 4))
    prompt = list(range(20))
    run_request(mgr, "r1", prompt, 1)
    pool = mgr.pools[0]
    assert mgr.get_num_cached_tokens(prompt) == 16
    # evict block 0's entry only: blocks 1.. are still cached but not a contiguous run
    h0 = next(h for h, b in pool.cached.items() if b.block_hash == h and b.block_id == 1)
    blk = pool.cached[h0]
    pool.free_queue.remove(blk)
    pool.free_queue.appendleft(blk)
    got = pool.allocate(1)
    assert got[0] is blk and h0 not in pool.cached
    assert mgr.get_num_cached_tokens(prompt) == 0
    pool.free(got)
    mgr.check_integrity()


# ---- C06 ------------------------------------------------------------------------------
def test_c06_copy_on_write_of_shared_partial_block() -> None:
    mgr = KVCacheManager(make_spec(16, 16))
    pool = mgr.pools[0]
    prompt = list(range(20))
    assert mgr.allocate("p", prompt, 20) is not None
    mgr.commit("p", prompt, 20)
    mgr.fork("p", "c")
    full, tail = mgr.block_table("p")
    assert mgr.block_table("c") == [full, tail]
    assert pool.blocks[full].ref_cnt == 2 and pool.blocks[tail].ref_cnt == 2
    a = mgr.allocate("p", [*prompt, 1], 1)
    assert a is not None and a.copies == [[(tail, a.copies[0][0][1])]]
    dst = a.copies[0][0][1]
    assert dst not in (0, full, tail) and a.new_blocks == [[]]
    assert mgr.block_table("p") == [full, dst] and mgr.block_table("c") == [full, tail]
    b = mgr.allocate("c", [*prompt, 2], 1)
    assert b is not None and b.copies == [[]]  # copied exactly once
    assert pool.blocks[tail].ref_cnt == 1 and pool.blocks[full].ref_cnt == 2
    mgr.commit("p", [*prompt, 1], 21)
    mgr.commit("c", [*prompt, 2], 21)
    assert mgr.stats.cow_copies == 1
    mgr.check_integrity()
    mgr.free("p")
    mgr.free("c")
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.num_free == 15
    mgr.check_integrity()


# ---- C07 (slots) -------------------------------------------------------------------------
def test_c07_chunked_prefill_after_hit_uses_absolute_positions() -> None:
    mgr = KVCacheManager(make_spec(32, 16))
    prompt = list(range(50))
    run_request(mgr, "warm", prompt[:40], 1)  # caches blocks 0 and 1 (tokens 0..31)
    hit = mgr.get_num_cached_tokens(prompt)
    assert hit == 32
    slots = []
    a = mgr.allocate("r", prompt, 8, num_cached_tokens=hit)
    assert a is not None and len(a.new_blocks[0]) == 1
    start = 32
    while True:
        table = mgr.block_table("r")
        n = mgr.num_allocated_tokens("r") - start
        slots.append(slot_mapping(table, start, n, 16))
        start += n
        mgr.commit("r", prompt, start)
        if start == 50:
            break
        assert mgr.allocate("r", prompt, min(8, 50 - start)) is not None
    table = mgr.block_table("r")
    got = np.concatenate(slots)
    want = [table[2] * 16 + o for o in range(16)] + [table[3] * 16 + o for o in range(2)]
    assert got.dtype == np.int64 and got.tolist() == want
    assert slot_mapping(table, 32, 18, 16).tolist() == want
    mgr.check_integrity()


# ---- C10 (freeing) -----------------------------------------------------------------------
def test_c10_sliding_window_frees_blocks_wholly_outside_window() -> None:
    mgr = KVCacheManager(make_spec(16, 2, windows=(4,)))
    pool = mgr.pools[0]
    toks = list(range(10))
    assert mgr.allocate("r", toks, 10) is not None
    mgr.commit("r", toks, 10)  # positions 0..9 written
    t0 = mgr.block_table("r")
    a = mgr.allocate("r", [*toks, 10], 1)  # query 10 sees keys 7..10
    assert a is not None
    t1 = mgr.block_table("r")
    assert t1[:3] == [0, 0, 0]  # [0,1], [2,3], [4,5] released
    assert t1[3:5] == t0[3:5]  # [6,7] and [8,9] kept
    assert all(pool.blocks[b].ref_cnt == 0 for b in t0[:3])
    assert all(pool.blocks[b].ref_cnt == 1 for b in t0[3:])
    assert mgr.stats.window_blocks_freed == 3
    mgr.check_integrity()


@pytest.mark.parametrize(("window", "block_size"), [(4, 2), (1, 1), (3, 2), (5, 4), (8, 4)])
def test_c10_decode_frees_exactly_the_blocks_below_the_window(window: int, block_size: int) -> None:
    mgr = KVCacheManager(make_spec(64, block_size, windows=(window, None)))
    toks = [3]
    assert mgr.allocate("r", toks, 1) is not None
    for p in range(1, 40):  # decode token p: it attends keys max(0, p-W+1) .. p
        mgr.commit("r", toks, p)
        toks.append(p)
        assert mgr.allocate("r", toks, 1) is not None
        assert mgr.windows == [None, window]  # full-attention group first
        full, sliding = mgr.block_table("r", 0), mgr.block_table("r", 1)
        first_key = max(0, p - window + 1)
        for i, b in enumerate(sliding):
            wholly_outside = (i + 1) * block_size <= first_key
            assert (b == 0) == wholly_outside, (p, i, sliding)
        assert 0 not in full
        mgr.check_integrity()


def test_sliding_only_model_hits_after_early_blocks_are_evicted() -> None:
    mgr = KVCacheManager(make_spec(64, 2, windows=(4,)))
    prompt = list(range(20))
    run_request(mgr, "a", prompt, 1)
    pool = mgr.pools[0]
    assert mgr.get_num_cached_tokens(prompt) == 18
    # drop block 0's entry: a sliding group still hits (only blocks near the end matter)
    b0 = next(b for b in pool.cached.values() if b.block_id == mgr.pools[0].blocks[1].block_id)
    pool.free_queue.remove(b0)
    pool.free_queue.appendleft(b0)
    taken = pool.allocate(1)
    assert mgr.get_num_cached_tokens(prompt) == 18
    a = mgr.allocate("b", prompt, 2, num_cached_tokens=18)
    assert a is not None
    table = mgr.block_table("b")
    assert table[:7] == [0] * 7 and 0 not in table[7:]  # keys 15.. needed for query 18
    pool.free(taken)
    mgr.check_integrity()


# ---- atomic failure ------------------------------------------------------------------------
def test_failed_allocation_changes_nothing_but_the_failure_count() -> None:
    mgr = KVCacheManager(make_spec(9, 2, windows=(None, 4)))
    prompt = list(range(8))
    run_request(mgr, "warm", prompt, 1)
    assert mgr.allocate("a", prompt, 3, num_cached_tokens=mgr.get_num_cached_tokens(prompt))
    mgr.commit("a", prompt, 6)
    mgr.fork("a", "b")  # shared partial block: the next write would copy it
    assert mgr.allocate("c", list(range(50, 55)), 5) is not None
    mgr.commit("c", list(range(50, 55)), 5)
    cases = [
        lambda: mgr.allocate("new", list(range(100, 130)), 30),  # first call, too big
        lambda: mgr.allocate("new", prompt, 6, num_cached_tokens=6),  # with a hit
        lambda: mgr.allocate("a", [*prompt, 9] * 3, 20),  # later call: CoW + window + new
        lambda: mgr.allocate("c", list(range(50, 80)), 25),
    ]
    for attempt in cases:
        before = snapshot(mgr)
        fails = mgr.stats.allocation_failures
        assert attempt() is None
        assert snapshot(mgr) == before
        assert mgr.stats.allocation_failures == fails + 1
        mgr.check_integrity()


def test_bad_input_raises_and_changes_nothing() -> None:
    mgr = KVCacheManager(make_spec(9, 4))
    assert mgr.allocate("a", list(range(6)), 6) is not None
    before = snapshot(mgr, ignore_failures=False)
    with pytest.raises(AllocationError):
        mgr.allocate("a", list(range(6)), -1)
    with pytest.raises(AllocationError):
        mgr.allocate("n", list(range(6)), 1, num_cached_tokens=3)  # not block aligned
    with pytest.raises(AllocationError):
        mgr.commit("a", list(range(6)), 7)
    with pytest.raises(AllocationError):
        mgr.commit("zz", list(range(6)), 1)
    with pytest.raises(AllocationError):
        mgr.fork("a", "a")
    with pytest.raises(AllocationError):
        mgr.block_table("zz")
    assert snapshot(mgr, ignore_failures=False) == before


def test_hybrid_hit_is_the_longest_prefix_every_group_can_serve() -> None:
    mgr = KVCacheManager(make_spec(32, 2, windows=(None, 4)))
    assert mgr.windows == [None, 4]
    prompt = list(range(10))
    run_request(mgr, "a", prompt, 1)
    assert mgr.get_num_cached_tokens(prompt) == 8  # capped at len - 1, block aligned
    # evict the sliding group's copy of block 3 (positions 6, 7) only
    sliding = mgr.pools[1]
    key = hash_request_blocks(prompt, 2)[3]
    blk = sliding.cached[key]
    sliding.free_queue.remove(blk)
    sliding.free_queue.appendleft(blk)
    taken = sliding.allocate(1)
    assert key not in sliding.cached and key in mgr.pools[0].cached
    # 8 tokens would need keys 5..7 in the sliding group (block 3 is gone); 6 tokens
    # need keys 3..5 (blocks 1, 2): still cached
    assert mgr.get_num_cached_tokens(prompt) == 6
    a = mgr.allocate("b", prompt, 4, num_cached_tokens=6)
    assert a is not None and a.num_cached_tokens == 6
    assert mgr.block_table("b", 1)[:1] == [0] and 0 not in mgr.block_table("b", 0)
    with pytest.raises(AllocationError, match="not cached"):
        mgr.allocate("c", prompt, 2, num_cached_tokens=8)
    sliding.free(taken)
    mgr.check_integrity()


def test_c11_bookkeeping_window_is_per_layer() -> None:
    # layer 0 sliding W 4, layer 1 full; block_size 4; 16-token prompt
    spec = make_spec(16, 4, windows=(4, None))
    assert [(g.layer_ids, g.sliding_window) for g in spec.kv_groups] == [((1,), None), ((0,), 4)]
    mgr = KVCacheManager(spec)
    toks = list(range(16))
    assert mgr.allocate("r", toks, 16) is not None
    mgr.commit("r", toks, 16)
    toks.append(16)
    assert mgr.allocate("r", toks, 1) is not None  # query 16: W 4 sees keys 13..16
    full, sliding = mgr.block_table("r", 0), mgr.block_table("r", 1)
    assert len(full) == len(sliding) == 5 and 0 not in full  # layer 1 keeps all 16 keys
    assert sliding[:3] == [0, 0, 0] and 0 not in sliding[3:]  # keys 12..15 kept
    mgr.check_integrity()
