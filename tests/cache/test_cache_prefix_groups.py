"""Prefix hits across any number of KV groups: ``get_num_cached_tokens`` against a
brute-force oracle over random hybrid layouts and random cached blocks per group, on the
unified pool and on per-group pools.

The oracle, from the definition (``kvpage.cache.prefix``): a hit of ``nb`` blocks (at
most ``(len(prompt) - 1) // block_size``) is usable when every full-attention group holds
blocks ``0 .. nb-1`` and every sliding group of window ``W`` holds the blocks that the
first computed token (position ``nb * block_size``) sees,
``max(0, nb*block_size - W + 1) // block_size .. nb-1``; the hit is the largest usable
``nb`` (0 always is).
"""

from __future__ import annotations

from cache_helpers import make_spec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.cache import KVCacheManager, hash_request_blocks

WINDOWS = st.sampled_from([None, None, 1, 2, 3, 5, 8, 13])


def oracle(windows: list[int | None], cached: list[set[int]], bs: int, cap: int) -> int:
    """The longest usable hit in blocks (module docstring), by trying every length."""
    for nb in range(cap, 0, -1):
        ok = True
        for w, have in zip(windows, cached):
            lo = 0 if w is None else max(0, nb * bs - w + 1) // bs
            if not all(i in have for i in range(lo, nb)):
                ok = False
                break
        if ok:
            return nb
    return 0


@settings(max_examples=120, deadline=None)
@given(
    layout=st.lists(WINDOWS, min_size=1, max_size=6),
    bs=st.sampled_from([1, 2, 4]),
    prompt_len=st.integers(1, 24),
    kv_pool=st.sampled_from(["unified", "per_group"]),
    data=st.data(),
)
def test_longest_hit_equals_brute_force_oracle(
    layout: list[int | None], bs: int, prompt_len: int, kv_pool: str, data: st.DataObject
) -> None:
    spec = make_spec(200, bs, layout, kv_pool)
    mgr = KVCacheManager(spec, hash_seed=3)
    assert mgr.num_groups == len(spec.kv_groups)
    prompt = list(range(7, 7 + prompt_len))
    hashes = hash_request_blocks(prompt, bs, hash_seed=3)
    nfull = len(hashes)
    # per group: which of the prompt's full blocks are cached (free, in the pool)
    cached = [
        set(data.draw(st.lists(st.integers(0, max(0, nfull - 1)), max_size=nfull)))
        if nfull
        else set()
        for _ in range(mgr.num_groups)
    ]
    for g, pool in enumerate(mgr.pools):
        for i in sorted(cached[g]):
            bid = pool.allocate_ids(1)[0]
            assert pool.cache_block(bid, hashes[i])
            pool.release([bid])
    mgr.check_integrity()
    want = oracle(mgr.windows, cached, bs, (prompt_len - 1) // bs)
    got = mgr.get_num_cached_tokens(prompt)
    assert got == want * bs
    # the hit can be taken: every group's needed blocks are found and held
    alloc = mgr.allocate("r", prompt, prompt_len - got, num_cached_tokens=got)
    assert alloc is not None and alloc.num_cached_tokens == got
    mgr.check_integrity()
    mgr.free("r")
    mgr.check_integrity()
    assert mgr.num_used_blocks == 0
