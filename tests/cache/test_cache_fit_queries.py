"""The KVCacheManager's read-only fit queries (``has_transient_blocks``,
``fit_new_tokens``, ``admission_demand``, ``growth_demand``; the scheduler's budget on
a unified pool with sliding groups), each checked against the allocator itself: a
brute force over copies of the manager."""

from __future__ import annotations

import copy
import random

import pytest
from cache_helpers import make_spec, snapshot

from kvpage.cache import KVCacheManager
from kvpage.errors import AllocationError

WINDOWS = (None, 6, 6, None)  # 4 groups of one layer: 2 full, 2 sliding (window 6)


def _mgr(pool: str, seed: int, nb: int = 0) -> tuple[KVCacheManager, dict[str, list[int]]]:
    """A manager with a few requests at random progress, prefix caching on, and some
    cached free blocks (a freed request)."""
    rng = random.Random(seed)
    nb = nb or (40 if pool == "unified" else 25)  # small: some fits are cut
    mgr = KVCacheManager(make_spec(nb, 4, WINDOWS, pool), max_alloc_tokens=32)
    toks: dict[str, list[int]] = {}
    for k in range(4):
        rid = f"r{k}"
        t = [rng.randrange(3) for _ in range(rng.randrange(8, 40))]
        done = 0
        while done < len(t):
            n = min(rng.randrange(1, 13), len(t) - done)
            if mgr.allocate(rid, t, n) is None:
                break
            done += n
            mgr.commit(rid, t, done)
        if not done:
            continue
        toks[rid] = t[:done]
        if k == 1:
            mgr.free(rid)
            del toks[rid]
    return mgr, toks


def _brute_fit(mgr: KVCacheManager, rid: str, t: list[int], n: int, **kw: int) -> list[int]:
    """Per ``m`` in 0..n, the free blocks after ``allocate(rid, t, m)`` on a copy
    (-1: refused)."""
    out = []
    for m in range(n + 1):
        c = copy.deepcopy(mgr)
        ok = (m or rid in c._reqs) and c.allocate(rid, t, m, **kw) is not None
        out.append(c.num_free_blocks if ok else -1)
    return out


def _best(free_after: list[int], keep: int) -> int:
    return max((m for m, f in enumerate(free_after) if f >= keep), default=0)


@pytest.mark.parametrize("pool", ["unified", "per_group"])
@pytest.mark.parametrize("seed", range(2))
def test_fit_new_tokens_equals_the_allocator(pool: str, seed: int) -> None:
    mgr, toks = _mgr(pool, seed)
    before = snapshot(mgr)
    rng = random.Random(seed)
    for rid, t in toks.items():
        t2 = t + [rng.randrange(3) for _ in range(32)]
        free_after = _brute_fit(mgr, rid, t2, 32)
        for keep in (0, 3, 11):
            got = mgr.fit_new_tokens(rid, t2, 32, keep_free=keep)
            assert got == _best(free_after, keep), (rid, keep)
    new = [rng.randrange(3) for _ in range(30)]
    cached = mgr.get_num_cached_tokens(new)
    free_after = _brute_fit(mgr, "new", new, 30 - cached, num_cached_tokens=cached)
    for keep in (0, 7):
        got = mgr.fit_new_tokens("new", new, 30 - cached, keep_free=keep, num_cached_tokens=cached)
        assert got == _best(free_after, keep)
    assert snapshot(mgr) == before  # read-only


@pytest.mark.parametrize("seed", range(4))
def test_admission_and_growth_demand_equal_the_settled_blocks(seed: int) -> None:
    """A new request's ``admission_demand(T)`` is the free blocks it takes when grown to
    ``T`` tokens in chunks and its window released at ``T`` (an allocation of 0 more
    tokens); ``growth_demand`` of a running one the same from where it stands."""
    mgr, toks = _mgr("unified", seed, 90)
    assert mgr.has_transient_blocks
    rng = random.Random(100 + seed)
    prompt = list(toks.get("r0", [0] * 8)[:8]) + [rng.randrange(3) for _ in range(40)]
    for T in (5, 17, 48):
        c = copy.deepcopy(mgr)
        cached = c.get_num_cached_tokens(prompt[:T])
        want_free = c.num_free_blocks
        need = c.admission_demand(prompt, T, num_cached_tokens=cached)
        done = cached
        first = True
        while done < T:
            n = min(9, T - done)
            assert c.allocate("x", prompt, n, num_cached_tokens=cached if first else 0)
            first = False
            done += n
            c.commit("x", prompt, done)
        c.allocate("x", prompt, 0)  # the window release at T
        assert want_free - c.num_free_blocks == need
        # growth from here to T + 7: the same settled count
        grow = c.growth_demand("x", T + 7)
        free = c.num_free_blocks
        assert c.allocate("x", prompt + [0] * 7, 7) is not None
        c.commit("x", prompt + [0] * 7, T + 7)
        c.allocate("x", prompt + [0] * 7, 0)
        assert free - c.num_free_blocks == grow


def test_fit_queries_refuse_bad_input_and_unknown_requests() -> None:
    mgr, _ = _mgr("unified", 0)
    with pytest.raises(AllocationError):
        mgr.fit_new_tokens("r0", [0] * 50, -1)
    with pytest.raises(AllocationError):
        mgr.fit_new_tokens("r0", [0] * 50, 4, keep_free=-1)
    with pytest.raises(AllocationError):
        mgr.growth_demand("nobody", 10)
    assert not KVCacheManager(make_spec(9, 4, (None, 6), "per_group")).has_transient_blocks
    assert not KVCacheManager(make_spec(9, 4, (None,), "unified")).has_transient_blocks
