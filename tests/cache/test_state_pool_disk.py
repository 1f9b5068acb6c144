"""Recurrent-state snapshots in the disk KV tier (kvpage.cache.state_pool with
kvpage.cache.tier_store.DiskTier): the eviction chain slot -> host row -> disk file
with the content each row held when it was evicted (queued copies run first), a new
pool over the same directory finding and restoring the files (a restart), a corrupt or
truncated file refused with its reason and never restored, the snapshot share of the
disk tier's byte budget shared with KV files, keys that never meet a KV key, and the
events of every place a snapshot lives."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvpage.cache import KVCacheManager, hash_request_blocks
from kvpage.cache.snapshot_policy import SnapshotPolicy
from kvpage.cache.state_pool import StatePool
from kvpage.cache.tier_store import (
    DiskTier,
    is_state_key,
    state_key,
    state_key_hash,
    tier_fingerprint,
)
from kvpage.cache.tiered import tier_key
from kvpage.errors import SpecError
from kvpage.specs import make_cache_spec
from kvpage.specs.state import StateSpec

BS = 16
N = 64  # bytes of one fake state row
FP = tier_fingerprint({"model": "state-disk-test", "format": 3})


def H(i: int) -> bytes:
    return bytes([i]) * 32


class RowMover:
    """A :class:`SnapshotMover` over a dict of rows (slot -> bytes; host rows at
    ``num_slots + row``), recording every call."""

    slot_nbytes = N

    def __init__(self) -> None:
        self.rows: dict[int, bytes] = {}
        self.calls: list[str] = []

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        for a, b in pairs:
            self.rows[b] = self.rows.get(a, bytes(N))
        self.calls.append(f"copy{list(pairs)}")

    def read_slot(self, slot: int) -> bytes:
        self.calls.append(f"read{slot}")
        return self.rows.get(slot, bytes(N))

    def write_slot(self, slot: int, payload: bytes) -> None:
        assert len(payload) == N
        self.rows[slot] = bytes(payload)
        self.calls.append(f"write{slot}")


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, str, bytes]] = []

    def on_snapshot_stored(self, block_hash: bytes, where: str) -> None:
        self.log.append(("stored", where, block_hash))

    def on_snapshot_removed(self, block_hash: bytes, where: str) -> None:
        self.log.append(("removed", where, block_hash))


def _pool(path: Path, host: int = 1, state_cap: int = 1 << 20) -> tuple[StatePool, RowMover]:
    pool = StatePool(2, 1, SnapshotPolicy(BS), num_host_snapshots=host)
    mover = RowMover()
    pool.attach_disk(DiskTier(path, 1 << 20, FP, state_capacity_bytes=state_cap), mover)
    return pool, mover


def _take(pool: StatePool, mover: RowMover, *snaps: tuple[bytes, int]) -> None:
    """One step: live sequences get the contents ``fill`` and are snapshotted as their
    hashes ``h`` (``snaps`` = ``(h, fill)`` pairs), the copies left queued."""
    mover.copy_slots(pool.take_copies())  # the engine runs queued copies before a step
    for _, fill in snaps:
        slot = pool.allocate_live(f"r{fill}")
        assert slot is not None
        mover.rows[slot] = bytes([fill]) * N  # "the step" writes the live state
    for h, fill in snaps:
        pool.take(f"r{fill}", h, "prompt")
    for _, fill in snaps:
        pool.free_live(f"r{fill}")


def test_slot_to_host_to_disk_keeps_each_rows_content_and_survives_restart(
    tmp_path: Path,
) -> None:
    pool, mover = _pool(tmp_path)
    ev = Events()
    pool.listeners.append(ev)
    _take(pool, mover, (H(1), 1))
    # one step: H(1) slot -> host row (queued), then H(2) -> host: the full row (H(1),
    # its copy still queued) goes to disk first, after the queued copies ran
    _take(pool, mover, (H(2), 2), (H(3), 3))
    assert pool.has_disk_snapshot(H(1)) and pool.has_host_snapshot(H(2))
    disk = pool.disk
    assert disk is not None and disk.state_keys() == [state_key(H(1))]
    # the file holds H(1)'s content, though its host copy was still queued at eviction
    assert disk.get(state_key(H(1))) == bytes([1]) * N
    assert pool.stats.disk_snapshots_stored == 1
    assert ("removed", "host", H(1)) in ev.log and ("stored", "disk", H(1)) in ev.log
    i = ev.log.index
    assert i(("removed", "device", H(2))) > i(("stored", "host", H(2))) > i(("stored", "disk", H(1)))  # fmt: skip
    assert pool.deepest([H(1)], 1) == 1 and pool.nearest([H(1), H(9)], 2) == 1
    mover.copy_slots(pool.take_copies())
    pool.check_integrity([])

    # a restart: a new tier and pool over the same directory find the file
    again, m2 = _pool(tmp_path)
    assert again.disk_snapshot_hashes() == [H(1)] and again.num_disk_used == 1
    assert again.lookup([H(1), H(7)], 2) == 1  # promoted into the snapshot slot
    slot = again.snapshot_slot(H(1))
    assert slot is not None and m2.rows[slot] == bytes([1]) * N
    assert again.stats.disk_snapshot_hits == 1 and again.has_disk_snapshot(H(1))  # inclusive
    again.allocate_live("x")
    again.restore("x", H(1))
    m2.copy_slots(again.take_copies())
    assert m2.rows[again.live_slot("x")] == bytes([1]) * N
    again.free_live("x")
    again.check_integrity([])
    assert again.reset() and again.num_disk_used == 0 and not list(tmp_path.rglob("*.kvb"))


def test_disk_promotion_writes_the_slot_after_its_eviction_copy(tmp_path: Path) -> None:
    """A disk hit into a full snapshot slot: the slot's snapshot goes to the host row
    (its queued copy runs before the disk payload overwrites the slot), the host row's
    to disk; every row ends with its own content."""
    pool, mover = _pool(tmp_path)
    _take(pool, mover, (H(1), 1))
    _take(pool, mover, (H(2), 2), (H(3), 3))  # slot H(3), host H(2), disk H(1)
    assert pool.lookup([H(1)], 1) == 1
    mover.copy_slots(pool.take_copies())
    n = pool.num_slots
    assert mover.rows[pool.num_live_slots] == bytes([1]) * N  # the slot: H(1) from disk
    assert pool.has_host_snapshot(H(3)) and mover.rows[n] == bytes([3]) * N
    disk = pool.disk
    assert disk is not None and disk.get(state_key(H(2))) == bytes([2]) * N
    pool.check_integrity([])


def test_no_host_rows_goes_straight_to_disk(tmp_path: Path) -> None:
    pool, mover = _pool(tmp_path, host=0)
    _take(pool, mover, (H(1), 1))
    _take(pool, mover, (H(2), 2))
    assert pool.has_disk_snapshot(H(1)) and pool.num_host_used == 0
    disk = pool.disk
    assert disk is not None and disk.get(state_key(H(1))) == bytes([1]) * N
    # a snapshot already on disk is not written again when evicted again
    assert pool.lookup([H(1)], 1) == 1
    calls = len(mover.calls)
    _take(pool, mover, (H(3), 3))
    assert pool.stats.disk_snapshots_stored == 2  # H(2); H(1)'s file was only touched
    assert not [c for c in mover.calls[calls:] if c.startswith("read") and c != "read2"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "size"])
def test_corrupt_or_truncated_file_is_a_miss_with_its_reason(tmp_path: Path, damage: str) -> None:
    pool, mover = _pool(tmp_path, host=0)
    _take(pool, mover, (H(1), 1), (H(2), 2))
    _take(pool, mover, (H(3), 3))  # H(1), H(2) on disk; H(3) in the slot
    disk = pool.disk
    assert disk is not None
    (f,) = [p for p in disk.dir.iterdir() if p.name.startswith(state_key(H(2)).hex())]
    raw = f.read_bytes()
    if damage == "flip":
        f.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    elif damage == "truncate":
        f.write_bytes(raw[:-5])
    else:  # a valid file of another row size (another layout written under this name)
        disk.discard(state_key(H(2)), "test")
        assert disk.put(state_key(H(2)), bytes(N + 8))
    chain = [H(1), H(2)]
    before = dict(mover.rows)
    assert pool.lookup(chain, 2) == 1  # H(2) refused: the hit falls back to H(1)
    want = "size" if damage == "size" else "corrupt"
    assert pool.refusal(H(2)) == want and pool.stats.disk_snapshot_refusals == 1
    assert not pool.has_disk_snapshot(H(2)) and not f.exists()
    assert disk.stats.corrupt >= 1
    slot = pool.snapshot_slot(H(1))
    assert slot is not None and mover.rows[slot] == bytes([1]) * N  # H(1)'s state, not H(2)'s
    assert all(mover.rows.get(k) == v for k, v in before.items() if k != slot)
    mover.copy_slots(pool.take_copies())
    pool.check_integrity([])
    _take(pool, mover, (H(2), 2))  # computed and snapshotted again: the refusal is moot
    assert pool.refusal(H(2)) is None


def test_state_share_of_the_disk_budget_and_keys(tmp_path: Path) -> None:
    # snapshot files: at most 2 rows' bytes; everything: 4 rows' bytes
    disk = DiskTier(tmp_path, 4 * N, FP, state_capacity_bytes=2 * N)
    for i in (1, 2, 3):
        assert disk.put(state_key(H(i)), bytes([i]) * N)
    assert disk.state_keys() == [state_key(H(2)), state_key(H(3))]  # the oldest went first
    assert disk.state_used_bytes == 2 * N and disk.used_bytes == 2 * N
    assert disk.put(H(10), bytes(N)) and disk.put(tier_key(1, H(10)), bytes(N))
    assert disk.used_bytes == 4 * N
    assert disk.put(H(11), bytes(N))  # a KV file evicts the oldest file: a snapshot
    assert disk.state_keys() == [state_key(H(3))] and disk.used_bytes == 4 * N
    assert not disk.put(state_key(H(4)), bytes(2 * N + 1))  # larger than the share
    # after a restart the share is applied to what is found (a smaller share now)
    small = DiskTier(tmp_path, 4 * N, FP, state_capacity_bytes=0)
    assert small.state_keys() == [] and len(small) == 3
    with pytest.raises(SpecError, match="state_capacity_bytes"):
        DiskTier(tmp_path, 4 * N, FP, state_capacity_bytes=5 * N)
    # a state key never equals a KV key of any group
    kv_keys = {tier_key(g, H(5)) for g in range(256)}
    assert state_key(H(5)) not in kv_keys and not any(is_state_key(k) for k in kv_keys)
    assert state_key_hash(state_key(H(5))) == H(5)
    with pytest.raises(SpecError, match="32 bytes"):
        state_key(b"short")
    with pytest.raises(SpecError, match="snapshot slots"):
        StatePool(1, 0, SnapshotPolicy(BS)).attach_disk(disk, RowMover())


def test_manager_hit_from_disk_and_refused_file_explained(tmp_path: Path) -> None:
    """Through KVCacheManager: a prompt's snapshot evicted to disk is the hit of the
    same prompt again (promoted by get_num_cached_tokens); a damaged file makes the
    miss explanation name the refusal."""
    st_layers = [
        StateSpec(
            kind="gated_deltanet", layer_id=0, conv_dim=4, conv_kernel=2, ssm_shape=(1, 2, 2)
        )  # fmt: skip
    ]
    spec = make_cache_spec(
        num_layers=1, block_size=BS, num_blocks=64,
        layers=[dict(num_q_heads=2, num_kv_heads=1, head_dim=8)], state_layers=st_layers,
    )  # fmt: skip
    pool, mover = _pool(tmp_path, host=0)
    kv = KVCacheManager(spec, state_pool=pool)
    a = list(range(3, 43))  # prompt boundary 32
    b = list(range(100, 140))

    def run(rid: str, toks: list[int]) -> int:
        hit = kv.get_num_cached_tokens(toks)
        done = hit
        while done < len(toks):
            end = kv.state_chunk_end(rid, toks, done, len(toks))
            assert kv.allocate(rid, toks, end - done, num_cached_tokens=hit if done == hit else 0) is not None  # fmt: skip
            kv.commit(rid, toks, end)
            done = end
        mover.copy_slots(kv.take_state_copies())
        kv.free(rid)
        return hit

    assert run("a", a) == 0 and run("b", b) == 0  # a's snapshot (boundary 32) to disk
    ha = hash_request_blocks(a, BS)
    assert pool.has_disk_snapshot(ha[1]) and not pool.has_snapshot(ha[1])
    assert run("a2", a) == 32 and pool.stats.disk_snapshot_hits == 1
    assert run("b2", b) == 32  # b's from disk; a's to disk again (file touched)
    disk = pool.disk
    assert disk is not None
    (f,) = [p for p in disk.dir.iterdir() if p.name.startswith(state_key(ha[1]).hex())]
    f.write_bytes(f.read_bytes()[:-3])
    assert kv.get_num_cached_tokens(a) == 0
    why = kv.explain_miss(a, 0)
    assert why.reason == "no_state_snapshot" and why.state_refused == "corrupt"
    assert "disk snapshot corrupt" in why.message and why.to_dict()["state_refused"] == "corrupt"
    kv.check_integrity()


def test_disk_full_stops_snapshot_files_and_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write (disk full) stops the tier taking files: the next evicted
    snapshot is lost (not stored, nothing raised), the files already there still
    restore."""
    pool, mover = _pool(tmp_path, host=0)
    _take(pool, mover, (H(1), 1))
    _take(pool, mover, (H(2), 2))  # H(1) to disk
    disk = pool.disk
    assert disk is not None

    def full(path: Path, chunks: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write_file", staticmethod(full))
    _take(pool, mover, (H(3), 3))  # H(2) evicted: the write fails
    assert not disk.writable and disk.stats.write_errors == 1
    assert not pool.has_disk_snapshot(H(2)) and pool.stats.disk_snapshots_stored == 1
    _take(pool, mover, (H(4), 4))  # H(3): the stopped tier is not even tried
    assert disk.stats.write_errors == 1 and not pool.has_disk_snapshot(H(3))
    assert pool.lookup([H(1)], 1) == 1
    slot = pool.snapshot_slot(H(1))
    assert slot is not None and mover.rows[slot] == bytes([1]) * N
    pool.check_integrity([])
