"""KV tiers per KV group on the unified pool: the cross-group tier hit against a
brute-force oracle over random hybrid layouts.

Each of the prompt's blocks is, per group, in the pool, in the host tier (under
``tier_key(group, hash)``) or nowhere. The oracle (as tests/cache/test_cache_prefix_groups.py,
with "available" = pool or tier): a hit of ``nb`` blocks is usable when every full group
has blocks ``0 .. nb-1`` and every sliding group of window ``W`` the blocks
``max(0, nb*bs - W + 1) // bs .. nb-1``; the hit is the largest usable ``nb``. The
lookup must return it, promote exactly the tier blocks that hit needs (bytes intact,
under the right group), leave every other tier entry where it was, and count the hit's
tier tokens.
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from cache_helpers import make_spec
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from test_cache_prefix_groups import WINDOWS, oracle

from kvpage.cache import KVCacheManager, hash_request_blocks
from kvpage.cache.tier_store import HostTier
from kvpage.cache.tiered import TieredCache, tier_key
from kvpage.errors import SpecError

NB = 300


def payload(key: bytes) -> bytes:
    """The 'K/V' a block of tier key ``key`` holds (a wrong group or block shows)."""
    return hashlib.blake2b(key, digest_size=32).digest()


class DictMover:
    """One group's block 'K/V' over the shared pool's block ids."""

    block_nbytes = 32

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}
        self.writes = 0

    def read_blocks(self, ids: Any) -> list[bytes]:
        return [self.data[i] for i in ids]

    def write_blocks(self, ids: Any, payloads: Any) -> None:
        self.writes += 1
        for i, p in zip(ids, payloads):
            self.data[i] = bytes(p)


@settings(max_examples=120, deadline=None)
@given(
    layout=st.lists(WINDOWS, min_size=2, max_size=5),
    bs=st.sampled_from([1, 2, 4]),
    prompt_len=st.integers(1, 24),
    data=st.data(),
)
def test_tier_hit_across_groups_equals_brute_force_oracle(
    layout: list[int | None], bs: int, prompt_len: int, data: st.DataObject
) -> None:
    mgr = KVCacheManager(make_spec(NB, bs, layout, "unified"), hash_seed=3)
    assume(mgr.num_groups >= 2)  # equal windows share one group
    assert mgr.unified
    movers = [DictMover() for _ in mgr.pools]
    tiers = TieredCache(list(mgr.pools), movers, host=HostTier(10**6))
    mgr.attach_tiers(tiers)
    prompt = list(range(7, 7 + prompt_len))
    hashes = hash_request_blocks(prompt, bs, hash_seed=3)
    nfull = len(hashes)
    place = [
        data.draw(st.lists(st.sampled_from("dh-"), min_size=nfull, max_size=nfull))
        for _ in mgr.pools
    ]
    for g, pool in enumerate(mgr.pools):
        for i, where in enumerate(place[g]):
            key = tier_key(g, hashes[i])
            if where == "d":
                bid = pool.allocate_ids(1)[0]
                movers[g].data[bid] = payload(key)
                assert pool.cache_block(bid, hashes[i])
                pool.release([bid])
            elif where == "h":
                assert tiers.host is not None
                assert tiers.host.put(key, payload(key)) == []
    mgr.check_integrity()
    avail = [{i for i, w in enumerate(row) if w != "-"} for row in place]
    cap = (prompt_len - 1) // bs
    want = oracle(mgr.windows, avail, bs, cap)
    got = mgr.get_num_cached_tokens(prompt)
    assert got == want * bs
    # promoted: exactly the host blocks the hit needs, per group; the rest stay in host
    needed = [
        set(range(0 if w is None else max(0, want * bs - w + 1) // bs, want)) for w in mgr.windows
    ]
    for g, pool in enumerate(mgr.pools):
        for i, where in enumerate(place[g]):
            key = tier_key(g, hashes[i])
            promoted = (
                where == "h"
                and i in needed[g]
                and bool(any(place[x][j] == "h" for x in range(len(place)) for j in needed[x]))
            )
            assert (key in tiers.host) is (where == "h" and not promoted)  # type: ignore[operator]
            if where != "-" and (where == "d" or promoted):
                bid = pool.cached_block_id(hashes[i])
                assert bid is not None and movers[g].data[bid] == payload(key)
    n_host = sum(place[g][i] == "h" for g in range(len(place)) for i in needed[g])
    assert tiers.host.stats.promotions == n_host  # type: ignore[union-attr]
    alloc = mgr.allocate("r", prompt, prompt_len - got, num_cached_tokens=got)
    assert alloc is not None and alloc.num_cached_tokens == got
    # a hit block counts for host when any group that takes it was promoted from host
    host_blocks = {i for g in range(len(place)) for i in needed[g] if place[g][i] == "h"}
    assert (alloc.cached_tokens_by_tier or {}).get("host", 0) == len(host_blocks) * bs
    mgr.check_integrity()
    mgr.free("r")
    mgr.check_integrity()
    assert mgr.num_used_blocks == 0


def test_tier_keys_keep_groups_apart_and_group_0_unchanged() -> None:
    h = hash_request_blocks(list(range(8)), 4)[0]
    assert tier_key(0, h) == h  # a one-group layout keys (and names files) as before
    keys = {tier_key(g, h) for g in range(4)}
    assert len(keys) == 4
    with pytest.raises(ValueError):
        tier_key(256, h)


def test_tiers_refuse_per_group_pools_and_mismatched_movers() -> None:
    mgr = KVCacheManager(make_spec(40, 4, [None, 8], "per_group"))
    tiers = TieredCache(list(mgr.pools), [DictMover(), DictMover()], host=HostTier(1024))
    with pytest.raises(SpecError, match="kv tiers: expected one full-attention KV group"):
        mgr.attach_tiers(tiers)
    uni = KVCacheManager(make_spec(40, 4, [None, 8], "unified"))
    with pytest.raises(SpecError, match="one mover per pool"):
        TieredCache(list(uni.pools), [DictMover()], host=HostTier(1024))
    with pytest.raises(SpecError, match="admissible_only"):
        TieredCache(
            list(uni.pools), [DictMover(), DictMover()], host=HostTier(1024)
        ).admissible_only = True
