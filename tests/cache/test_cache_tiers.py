"""KV tiers below the pool (kvpage.cache.tier_store / tiered): demotion, promotion,
per-tier hit accounting, listeners, restart survival of the disk tier, and the fault
cases: a file truncated, corrupted, replaced or deleted underneath (a counted miss,
never served), and a full disk (demotion stops, serving goes on)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import make_spec

from kvpage.cache import KVCacheManager, hash_request_blocks
from kvpage.cache.tier_store import DiskTier, HostTier, tier_fingerprint
from kvpage.cache.tiered import TieredCache
from kvpage.errors import SpecError

BS = 4
FP = tier_fingerprint({"model": "test", "block_size": BS})


class DictMover:
    """Block 'K/V' = bytes per block id; a payload is a copy of them."""

    block_nbytes = 32

    def __init__(self, num_blocks: int) -> None:
        self.data = {i: bytes(32) for i in range(num_blocks)}

    def read_blocks(self, ids: Any) -> list[bytes]:
        return [bytes(self.data[i]) for i in ids]

    def write_blocks(self, ids: Any, payloads: Any) -> None:
        for i, p in zip(ids, payloads):
            self.data[i] = bytes(p)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_demoted(self, h: bytes, tier: str) -> None:
        self.events.append(("demoted", h, tier))

    def on_promoted(self, h: bytes, tier: str) -> None:
        self.events.append(("promoted", h, tier))

    def on_dropped(self, h: bytes, tier: str, reason: str) -> None:
        self.events.append(("dropped", h, tier, reason))


def content(tokens: list[int], i: int) -> bytes:
    """The 'K/V' of block i of a request: determined by its hash (so a wrong block
    promoted shows up as wrong bytes)."""
    return hash_request_blocks(tokens, BS)[i]


def build(
    tmp: Path | None, num_blocks: int = 6, host_blocks: int = 2, disk_blocks: int = 8
) -> tuple[KVCacheManager, TieredCache, DictMover]:
    mgr = KVCacheManager(make_spec(num_blocks, BS))
    mover = DictMover(num_blocks)
    host = HostTier(host_blocks * 32) if host_blocks else None
    disk = DiskTier(tmp, disk_blocks * 32, FP) if tmp is not None and disk_blocks else None
    tiers = TieredCache(mgr.pools[0], mover, host=host, disk=disk)
    mgr.attach_tiers(tiers)
    return mgr, tiers, mover


def run(mgr: KVCacheManager, mover: DictMover, rid: str, tokens: list[int]) -> dict[str, int]:
    """Admit, 'compute' (write each block's content), commit, free; returns the hit by
    tier after checking every hit block holds the right content."""
    hit = mgr.get_num_cached_tokens(tokens)
    alloc = mgr.allocate(rid, tokens, len(tokens) - hit, num_cached_tokens=hit)
    assert alloc is not None
    table = mgr.block_table(rid)
    if mgr.tiers is not None:
        mgr.tiers.flush()  # the engine's step order: flush, then the forward writes
    for i in range(hit // BS):
        assert mover.data[table[i]] == content(tokens, i), "wrong K/V served"
    for i in range(hit // BS, len(tokens) // BS):
        mover.data[table[i]] = content(tokens, i)
    mgr.commit(rid, tokens, len(tokens))
    mgr.free(rid)
    mgr.check_integrity()
    return dict(alloc.cached_tokens_by_tier or {})


A = list(range(100, 117))  # 4 full blocks + 1 token
B = list(range(200, 217))
C = list(range(300, 317))


def test_evicted_blocks_come_back_from_host_then_disk(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path)
    rec = Recorder()
    assert tiers.host is not None and tiers.disk is not None
    tiers.host.listeners.append(rec)
    tiers.disk.listeners.append(rec)
    assert run(mgr, mover, "a", A) == {"device": 0}
    run(mgr, mover, "b", B)  # evicts A's 4 blocks: 2 stay in host, 2 go on to disk
    assert tiers.host.stats.demotions == 4 and len(tiers.host) == 2
    assert tiers.disk.stats.demotions == 2
    assert ("dropped", content(A, 3), "host", "capacity") in rec.events
    by_tier = run(mgr, mover, "a2", A)
    assert by_tier == {"device": 0, "host": 8, "disk": 8}
    assert tiers.host.stats.hits_tokens == 8 and tiers.disk.stats.hits_tokens == 8
    assert ("promoted", content(A, 0), "host") in rec.events
    assert ("promoted", content(A, 3), "disk") in rec.events
    assert mgr.stats.prefix_hits_tokens == 16
    # a second lookup finds A in the pool: device hits, no new promotion
    promotions = tiers.disk.stats.promotions
    assert run(mgr, mover, "a3", A) == {"device": 16}
    assert tiers.disk.stats.promotions == promotions


def test_host_tier_is_exclusive_and_byte_exact() -> None:
    mgr, tiers, mover = build(None, host_blocks=8)
    host = tiers.host
    assert host is not None
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    assert host.used_bytes == 4 * 32 and len(host) == 4
    run(mgr, mover, "a2", A)  # promoted out of host: host and pool stay exclusive
    assert not any(h in mgr.pools[0].cached for h in host.hashes())
    assert host.used_bytes == 32 * len(host) <= host.capacity_bytes


def test_tenant_salt_isolates_tiers(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path)
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    hit = mgr.get_num_cached_tokens(A, cache_salt="other-tenant")
    assert hit == 0


def test_disk_tier_survives_restart_and_refuses_other_fingerprint(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=0)
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)  # A's blocks now on disk
    assert tiers.disk is not None and tiers.disk.stats.demotions == 4
    # a new process: same path and fingerprint -> hits
    mgr2, tiers2, mover2 = build(tmp_path, host_blocks=0)
    assert tiers2.disk is not None and len(tiers2.disk) == 4
    assert run(mgr2, mover2, "a", A) == {"device": 0, "disk": 16}
    # another fingerprint (model / dtype / block size ...) sees none of those files
    other = DiskTier(tmp_path, 1 << 20, tier_fingerprint({"model": "other"}))
    assert len(other) == 0


@pytest.mark.parametrize("how", ["truncate", "flip", "delete", "replace", "header"])
def test_damaged_file_is_a_counted_miss_never_served(tmp_path: Path, how: str) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=0)
    disk = tiers.disk
    assert disk is not None
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    victim = disk.dir / (content(A, 1).hex() + ".kvb")
    raw = victim.read_bytes()
    if how == "truncate":
        victim.write_bytes(raw[:-5])
    elif how == "flip":
        victim.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif how == "delete":
        victim.unlink()
    elif how == "replace":  # a valid file of another block under this name
        victim.write_bytes((disk.dir / (content(A, 2).hex() + ".kvb")).read_bytes())
    else:
        victim.write_bytes(b"XXXXXXXX" + raw[8:])
    by_tier = run(mgr, mover, "a2", A)  # asserts the served blocks are the right ones
    assert by_tier == {"device": 0, "disk": 4}  # block 0 only: the hit stops at block 1
    assert disk.stats.corrupt == 1
    assert content(A, 1) not in disk and not victim.exists()


def test_disk_full_stops_demotion_serving_continues(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=0)
    disk = tiers.disk
    assert disk is not None

    def enospc(path: Path, chunks: Any) -> None:
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    disk._write_file = enospc  # type: ignore[method-assign]
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)  # evictions try the disk: the first write fails
    assert disk.stats.write_errors == 1 and not disk.writable
    assert "ENOSPC" in disk.last_write_error
    assert len(disk) == 0 and not list(disk.dir.glob("*.tmp"))
    assert tiers.demote_failures == 4
    for rid, toks in (("c", C), ("a2", A), ("b2", B)):  # serving goes on
        run(mgr, mover, rid, toks)


def test_disk_capacity_evicts_oldest_files(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=0, disk_blocks=3)
    disk = tiers.disk
    assert disk is not None
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    assert len(disk) == 3 and disk.used_bytes == 96
    assert len(list(disk.dir.glob("*.kvb"))) == 3
    # a restart with a smaller capacity trims at start
    small = DiskTier(tmp_path, 64, FP)
    assert len(small) == 2 and len(list(small.dir.glob("*.kvb"))) == 2


def test_reset_prefix_cache_clears_tiers(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path)
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    assert mgr.reset_prefix_cache()
    assert all(len(t) == 0 and t.used_bytes == 0 for t in tiers.tiers)
    assert not list(tiers.disk.dir.glob("*.kvb"))  # type: ignore[union-attr]


def test_bad_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="capacity_bytes"):
        HostTier(-1)
    with pytest.raises(SpecError, match="fingerprint"):
        DiskTier(tmp_path, 10, b"short")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SpecError, match="kv_disk_tier_path"):
        DiskTier(f, 10, FP)
    mgr = KVCacheManager(make_spec(5, BS, (None, 4)))
    with pytest.raises(SpecError, match="one full-attention KV group"):
        mgr.attach_tiers(TieredCache(mgr.pools[0], DictMover(5), host=HostTier(64)))
    with pytest.raises(SpecError, match="host or a disk"):
        TieredCache(mgr.pools[0], DictMover(5))


def test_admissible_only_waits_until_the_prompt_fits(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path)
    tiers.admissible_only = True
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)  # A in host + disk
    held = mgr.allocate("x", C[:12], 12)  # 3 of the 5 usable blocks in use
    assert held is not None
    tiers.flush()  # x's step: the engine flushes the evicted B blocks before its forward
    host = tiers.host
    assert host is not None
    before = (len(host), host.stats.promotions)
    assert mgr.get_num_cached_tokens(A) == 0  # A needs 5 blocks, 2 are free: not now
    assert (len(host), host.stats.promotions) == before
    assert tiers.promotions_deferred == 1
    mgr.free("x")
    # (x's allocation evicted B into host, which pushed A's host blocks on to disk)
    assert run(mgr, mover, "a2", A) == {"device": 0, "disk": 16}


def test_default_promotes_even_when_not_admissible_yet(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path)
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    assert mgr.allocate("x", C[:12], 12) is not None  # 2 free blocks left
    assert mgr.get_num_cached_tokens(A) == 8  # two blocks promoted (a prefetch)
    assert tiers.promotions_deferred == 0
    mgr.check_integrity()


def test_host_eviction_after_disk_full_is_reported_as_write_error(tmp_path: Path) -> None:
    mgr, tiers, mover = build(tmp_path, host_blocks=1)
    rec = Recorder()
    assert tiers.host is not None and tiers.disk is not None
    tiers.host.listeners.append(rec)

    def enospc(path: Path, chunks: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    tiers.disk._write_file = enospc  # type: ignore[method-assign]
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)
    reasons = [e[3] for e in rec.events if e[0] == "dropped"]
    assert reasons and set(reasons) == {"write_error"}
    assert tiers.demote_failures == len(reasons)


class CountingMover(DictMover):
    """DictMover that records the ids of every ``read_blocks`` call."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.reads: list[list[int]] = []

    def read_blocks(self, ids: Any) -> list[bytes]:
        self.reads.append(list(ids))
        return super().read_blocks(ids)


def build_counting(tmp: Path) -> tuple[KVCacheManager, TieredCache, CountingMover]:
    mgr = KVCacheManager(make_spec(6, BS))
    mover = CountingMover(6)
    tiers = TieredCache(mgr.pools[0], mover, host=HostTier(2 * 32), disk=DiskTier(tmp, 8 * 32, FP))
    mgr.attach_tiers(tiers)
    return mgr, tiers, mover


def test_evictions_of_one_step_are_one_batched_read(tmp_path: Path) -> None:
    mgr, tiers, mover = build_counting(tmp_path)
    run(mgr, mover, "a", A)
    assert mover.reads == [] and tiers.pending == []
    # scheduling B evicts A's 4 cached blocks: recorded, nothing copied yet
    assert mgr.allocate("b", B, len(B)) is not None
    evicted = [bid for bid, _ in tiers.pending]
    assert len(evicted) == 4 and mover.reads == []
    assert all(tiers.where(content(A, i)) == [] for i in range(4))  # in no tier yet
    assert tiers.flush() == 4
    assert mover.reads == [evicted]  # exactly one read_blocks call with the 4 ids
    assert tiers.flush() == 0 and mover.reads == [evicted]  # nothing pending: no call
    assert tiers.host is not None and tiers.disk is not None
    assert tiers.host.stats.demotions == 4 and tiers.disk.stats.demotions == 2
    assert tiers.host.stats.transfer_s > 0


def test_lookup_in_the_eviction_step_finds_pending_blocks(tmp_path: Path) -> None:
    mgr, tiers, mover = build_counting(tmp_path)
    run(mgr, mover, "a", A)
    assert mgr.allocate("b", B, len(B)) is not None  # evicts A (pending)
    mgr.free("b")  # B never ran: its blocks (A's old K/V) go back to the free queue
    assert len(tiers.pending) == 4
    # the lookup of the same step flushes first and promotes A back, bit-exact
    assert run(mgr, mover, "a2", A) == {"device": 0, "host": 8, "disk": 8}
    assert len(mover.reads) == 1 and tiers.pending == []


def test_store_of_a_pending_block_id_flushes_it_first(tmp_path: Path) -> None:
    mgr, tiers, mover = build_counting(tmp_path)
    run(mgr, mover, "a", A)
    assert mgr.allocate("b", B, len(B)) is not None  # reuses A's evicted block ids
    assert len(tiers.pending) == 4
    # caching a reused block id before any flush: that block is copied out first,
    # while it still holds A's K/V (nothing was written into it yet)
    mgr.commit("b", B, len(B))
    assert tiers.pending == [] and len(mover.reads) == 1
    assert tiers.host is not None and tiers.disk is not None
    for i in range(4):
        h = content(A, i)
        got = tiers.host._data.get(h) if h in tiers.host else tiers.disk.get(h)
        assert got == content(A, i), "a pending block was demoted with other content"


def test_reset_forgets_pending_blocks(tmp_path: Path) -> None:
    mgr, tiers, mover = build_counting(tmp_path)
    run(mgr, mover, "a", A)
    assert mgr.allocate("b", B, len(B)) is not None
    mgr.free("b")
    assert len(tiers.pending) == 4
    assert mgr.reset_prefix_cache()
    assert tiers.pending == [] and tiers.flush() == 0 and mover.reads == []


def test_unusable_disk_files_are_removed_and_counted_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 23: zero-length and header-only files were skipped at start-up, never
    removed nor counted (the docs say corrupt files are removed)."""
    mgr, tiers, mover = build(tmp_path, host_blocks=0)
    run(mgr, mover, "a", A)
    run(mgr, mover, "b", B)  # A's 4 blocks on disk
    assert tiers.disk is not None
    d = tiers.disk.dir
    files = sorted(d.glob("*.kvb"))
    files[0].write_bytes(b"")  # zero-length
    raw = files[1].read_bytes()
    files[1].write_bytes(raw[: len(raw) - 4 * 1024] if len(raw) > 8192 else raw[:40])
    header_only = d / ("ab" * 16 + ".kvb")
    header_only.write_bytes(b"KVPGBLK1" + FP)  # a header without the rest
    stray = d / "notes.txt"
    stray.write_text("not ours")
    with caplog.at_level("WARNING", logger="kvpage.cache"):
        disk = DiskTier(tmp_path, 1 << 20, FP)
    assert disk.stats.removed_at_start == 3 and disk.stats.corrupt == 3
    assert len(disk) == 2  # the two intact blocks
    assert not files[0].exists() and not files[1].exists() and not header_only.exists()
    assert stray.exists()  # not a block file: left alone
    assert [r.getMessage() for r in caplog.records if "removed 3 file" in r.getMessage()]


def test_disk_write_failure_warns_once_on_the_console(tmp_path: Path) -> None:
    """Without any logging configured (``kvpage generate``), the first failed write is
    printed on stderr once; later demotions do not repeat it."""
    import subprocess
    import sys

    code = f"""
import errno
from kvpage.cache.tier_store import DiskTier, tier_fingerprint
d = DiskTier({str(tmp_path)!r}, 1 << 20, tier_fingerprint({{"m": 1}}))
def full(path, chunks):
    raise OSError(errno.ENOSPC, "No space left on device")
d._write_file = full
for i in range(3):
    assert d.put(bytes([i]) * 16, b"x" * 64) is False
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stderr.count("write failed") == 1, out.stderr
    assert "ENOSPC" in out.stderr
