"""Block hashing: chaining, extra keys, seeds, stability across processes; step arrays."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from cache_helpers import make_spec
from hypothesis import given
from hypothesis import strategies as st

from kvpage.cache import (
    KVCacheManager,
    batch_block_tables,
    hash_block_tokens,
    hash_request_blocks,
    root_hash,
    slot_mapping,
)
from kvpage.errors import ShapeError, SpecError

TOKENS = [5, 17, 3, 250000, 0, 9, 31999, 2, 7, 7]


def test_chain_matches_single_block_hashes_and_documented_bytes() -> None:
    hs = hash_request_blocks(TOKENS, 4, cache_salt="s", hash_seed=3)
    assert len(hs) == 2  # the partial last block (2 tokens) is not hashed
    h0 = hash_block_tokens(None, TOKENS[:4], cache_salt="s", hash_seed=3)
    h1 = hash_block_tokens(h0, TOKENS[4:8], cache_salt="s")
    assert hs == [h0, h1] and len(h0) == 32
    # the byte layout documented in kvpage.cache.hashing, recomputed by hand
    root = hashlib.sha256(b"kvpage.root.v1" + struct.pack("<q", 3)).digest()
    extra = b"\x01" + struct.pack("<I", 1) + b"s" + b"\x00"
    want = hashlib.sha256(
        b"kvpage.block.v1" + root + extra + struct.pack("<4q", *TOKENS[:4])
    ).digest()
    assert root_hash(3) == root and h0 == want


def test_extra_keys_seed_and_parent_change_the_hash() -> None:
    base = hash_request_blocks(TOKENS, 4)
    assert hash_request_blocks(TOKENS, 4, cache_salt="a") != base
    assert hash_request_blocks(TOKENS, 4, adapter_id="a") != base
    assert hash_request_blocks(TOKENS, 4, cache_salt="a") != hash_request_blocks(
        TOKENS, 4, adapter_id="a"
    )
    assert hash_request_blocks(TOKENS, 4, hash_seed=1) != base
    # same block tokens after a different first block: different hash (chained)
    other = [9, 9, 9, 9, *TOKENS[4:8]]
    assert hash_request_blocks(other, 4)[1] != base[1]
    assert hash_request_blocks(TOKENS, 4, max_blocks=1) == base[:1]
    assert hash_request_blocks(np.array(TOKENS), 4) == base  # numpy ints hash the same


def test_bad_hash_inputs() -> None:
    with pytest.raises(SpecError, match="hash_seed"):
        root_hash(2**63)
    with pytest.raises(SpecError, match="token_ids"):
        hash_request_blocks([2**64, 1], 2)
    with pytest.raises(SpecError, match="block_size"):
        hash_request_blocks([1, 2], 0)


def test_hashes_stable_across_processes() -> None:
    code = (
        "import json; from kvpage.cache import hash_request_blocks as h;"
        f"print(json.dumps([x.hex() for x in h({TOKENS!r}, 2, cache_salt='t', "
        "adapter_id='lora', hash_seed=42)]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    mine = [
        x.hex()
        for x in hash_request_blocks(TOKENS, 2, cache_salt="t", adapter_id="lora", hash_seed=42)
    ]
    assert json.loads(out.stdout) == mine


def test_manager_keys_equal_router_keys() -> None:
    mgr = KVCacheManager(make_spec(16, 4), hash_seed=7)
    assert mgr.allocate("r", TOKENS, len(TOKENS), cache_salt="x") is not None
    mgr.commit("r", TOKENS, len(TOKENS))
    keys = set(mgr.pools[0].cached)
    assert keys == set(hash_request_blocks(TOKENS, 4, cache_salt="x", hash_seed=7))
    assert mgr.get_num_cached_tokens(TOKENS, cache_salt="x") == 8
    assert mgr.get_num_cached_tokens(TOKENS) == 0  # another salt never shares
    assert mgr.get_num_cached_tokens(TOKENS, cache_salt="x", adapter_id="a") == 0
    other = KVCacheManager(make_spec(16, 4), hash_seed=8)
    assert other.allocate("r", TOKENS, len(TOKENS), cache_salt="x") is not None
    other.commit("r", TOKENS, len(TOKENS))
    assert set(other.pools[0].cached).isdisjoint(keys)


def test_prefix_caching_off_never_hits() -> None:
    mgr = KVCacheManager(make_spec(16, 4), enable_prefix_caching=False)
    assert mgr.allocate("r", TOKENS, 10) is not None
    mgr.commit("r", TOKENS, 10)
    mgr.free("r")
    assert mgr.get_num_cached_tokens(TOKENS) == 0 and mgr.pools[0].cached == {}
    with pytest.raises(Exception, match="num_cached_tokens"):
        mgr.allocate("s", TOKENS, 2, num_cached_tokens=8)


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(make_spec(16, 4))
    assert mgr.allocate("r", TOKENS, 10) is not None
    mgr.commit("r", TOKENS, 10)
    assert mgr.reset_prefix_cache() is False  # a request holds blocks
    assert mgr.get_num_cached_tokens(TOKENS) == 8
    mgr.free("r")
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_num_cached_tokens(TOKENS) == 0
    mgr.check_integrity()


# ---- slot mapping / batched block tables ------------------------------------------------
def test_slot_mapping_and_batch_tables() -> None:
    table = [7, 3, 9]
    got = slot_mapping(table, 3, 6, 4)
    assert got.dtype == np.int64
    assert got.tolist() == [7 * 4 + 3, 3 * 4, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 9 * 4]
    assert slot_mapping(table, 5, 0, 4).shape == (0,)
    with pytest.raises(ShapeError):
        slot_mapping(table, 10, 3, 4)  # position 12 is past the table
    with pytest.raises(ShapeError):
        slot_mapping(table, -1, 1, 4)
    bt = batch_block_tables([[1, 2, 3], [], [4]])
    assert bt.dtype == np.int32
    assert bt.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]]
    assert batch_block_tables([]).shape == (0, 0)
    assert batch_block_tables([[5]], pad=0).tolist() == [[5]]


@given(
    block_size=st.integers(1, 8),
    table=st.lists(st.integers(0, 1000), min_size=1, max_size=12, unique=True),
    data=st.data(),
)
def test_slot_mapping_matches_the_formula(
    block_size: int, table: list[int], data: st.DataObject
) -> None:
    cap = len(table) * block_size
    start = data.draw(st.integers(0, cap - 1))
    n = data.draw(st.integers(0, cap - start))
    got = slot_mapping(table, start, n, block_size)
    want = [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
    assert got.dtype == np.int64 and got.tolist() == want
    # chunking the positions never changes the slots (C07)
    mid = data.draw(st.integers(start, start + n))
    parts = np.concatenate(
        [
            slot_mapping(table, start, mid - start, block_size),
            slot_mapping(table, mid, start + n - mid, block_size),
        ]
    )
    assert parts.tolist() == want


def test_allocate_never_reuses_hashes_of_another_peek() -> None:
    mgr = KVCacheManager(make_spec(32, 4))
    a, b = list(range(10)), list(range(50, 60))
    for rid, toks, salt in (("a", a, None), ("b", b, None), ("as", a, "s")):
        assert mgr.allocate(rid, toks, 10, cache_salt=salt) is not None
        mgr.commit(rid, toks, 10)
    assert mgr.get_num_cached_tokens(a) == 8  # the peek remembers a's hashes
    got = mgr.allocate("b2", b, 2, num_cached_tokens=8)  # ... but b is allocated
    assert got is not None and mgr.block_table("b2")[:2] == mgr.block_table("b")[:2]
    assert mgr.get_num_cached_tokens(a) == 8
    got = mgr.allocate("as2", a, 2, num_cached_tokens=8, cache_salt="s")  # other salt
    assert got is not None and mgr.block_table("as2")[:2] == mgr.block_table("as")[:2]
    assert mgr.get_num_cached_tokens(a) == 8
    assert mgr.allocate("a2", a, 2, num_cached_tokens=8) is not None  # the memo itself
    assert mgr.block_table("a2")[:2] == mgr.block_table("a")[:2]
    mgr.check_integrity()


def test_slot_mapping_refusals_name_the_numbers() -> None:
    """Each bad argument alone is refused with the full message (block_size 0 with
    valid start and count included); the table-length message gives the blocks needed
    and the last position. Written for mutmut survivors (docs/mutation-testing.md)."""

    from kvpage.cache.tables import slot_mapping
    from kvpage.errors import ShapeError

    for args in ((-1, 1, 2), (0, -1, 2), (0, 1, 0)):
        want = (
            r"^slot_mapping: expected start >= 0, num_tokens >= 0, block_size >= 1, "
            rf"got {args[0]}, {args[1]}, {args[2]}$"
        )
        with pytest.raises(ShapeError, match=want):
            slot_mapping([3, 4], *args)
    with pytest.raises(
        ShapeError, match=r"^block_table: expected >= 3 blocks for positions up to 4, got 2$"
    ):
        slot_mapping([3, 4], 2, 3, 2)  # positions 2..4 need blocks 0..2
    assert slot_mapping([3, 4], 2, 2, 2).tolist() == [8, 9]  # exactly enough blocks
