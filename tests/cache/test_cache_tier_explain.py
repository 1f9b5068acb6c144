"""Cache-miss explanations know about the KV tiers: a block a tier drops (capacity LRU,
corrupt file, full disk, reset) is recorded with that tier and reason, and a block
promoted back into the pool has its record forgotten (kvpage.cache.prefix_cache)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from test_cache_tiers import A, B, C, build, content, run

from kvpage.cache import KVCacheManager
from kvpage.cache.explain import CacheMissExplanation


def lookup_and_explain(mgr: KVCacheManager, rid: str, tokens: list[int]) -> CacheMissExplanation:
    hit = mgr.get_num_cached_tokens(tokens)
    assert mgr.allocate(rid, tokens, len(tokens) - hit, num_cached_tokens=hit) is not None
    got = mgr.explain_miss(tokens, hit)
    mgr.free(rid)
    return got


def test_miss_after_a_host_lru_drop_says_evicted_from_host_by_lru() -> None:
    mgr, tiers, mover = build(None, host_blocks=2)  # host holds 2 of A's 4 blocks
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)  # A evicted last block first: A3, A2 pass through host
    assert tiers.host is not None and content(A, 2) not in tiers.host
    ex = lookup_and_explain(mgr, "a2", A)
    assert ex.num_cached_tokens == 8  # A0, A1 promoted from host
    assert (ex.reason, ex.first_miss_block, ex.tier, ex.policy) == ("evicted", 2, "host", "lru")
    # the promoted blocks' device-eviction records are forgotten
    assert mgr.eviction_record.get(content(A, 0)) is None
    assert mgr.eviction_record.get(content(A, 2))[:2] == ("host", "lru")  # type: ignore[index]


def test_without_tiers_the_same_miss_is_a_device_eviction() -> None:
    mgr, _, mover = build(None, host_blocks=2)
    mgr2 = KVCacheManager(mgr.spec)  # same layout, no tiers: the baseline
    for rid, toks in (("a", A), ("b", B)):
        hit = mgr2.get_num_cached_tokens(toks)
        assert mgr2.allocate(rid, toks, len(toks) - hit, num_cached_tokens=hit) is not None
        mgr2.commit(rid, toks, len(toks))
        mgr2.free(rid)
    ex = lookup_and_explain(mgr2, "a2", A)
    assert (ex.reason, ex.first_miss_block, ex.tier, ex.policy) == ("evicted", 0, "device", "lru")


def test_corrupt_disk_file_is_explained_as_a_disk_corrupt_eviction(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=0)
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)  # A's blocks on disk
    assert tiers.disk is not None
    victim = tiers.disk.dir / (content(A, 0).hex() + ".kvb")
    victim.write_bytes(victim.read_bytes()[:-3])
    ex = lookup_and_explain(mgr, "a2", A)
    assert (ex.reason, ex.first_miss_block, ex.tier, ex.policy) == ("evicted", 0, "disk", "corrupt")


def test_full_disk_is_explained_as_a_disk_write_error(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=0)
    disk = tiers.disk
    assert disk is not None

    def enospc(path: Path, chunks: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    disk._write_file = enospc  # type: ignore[method-assign]
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    assert disk.stats.drops == 4 and len(disk) == 0
    ex = lookup_and_explain(mgr, "a2", A)
    assert (ex.reason, ex.tier, ex.policy) == ("evicted", "disk", "write_error")


def test_disk_capacity_and_reset_are_recorded(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=0, disk_blocks=3)
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    run(mgr, mover, "c", C)  # the 3-block disk tier drops A's files first
    got = mgr.eviction_record.get(content(A, 0))
    assert got is not None and got[:2] == ("disk", "lru")
    assert mgr.reset_prefix_cache()
    for h in [content(C, i) for i in range(4)]:
        rec = mgr.eviction_record.get(h)
        assert rec is not None and rec[1] == "reset"
