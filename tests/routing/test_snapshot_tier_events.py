"""Recurrent-state snapshots below the state slots in the KV event stream (issue 26):
a snapshot moved to a host row or a disk tier file is an event of medium
"state_host" / "state_disk" (as a KV block moved to a tier), a hit promoting it back
the reverse, the disk tier's snapshot files are never announced as KV disk blocks, and
the router's PrefixIndex fed by these events counts, before every request, what the
replica's own lookup (KVCacheManager.get_num_cached_tokens, promoting from every tier)
then serves."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from kvpage.cache import KVCacheManager, hash_request_blocks
from kvpage.cache.snapshot_policy import SnapshotPolicy
from kvpage.cache.state_pool import StatePool
from kvpage.cache.tier_store import DiskTier, HostTier, is_state_key, tier_fingerprint
from kvpage.cache.tiered import TieredCache
from kvpage.routing import KVEventPublisher, PrefixIndex
from kvpage.routing.events import BlockRemoved, BlockStored, KVSnapshot
from kvpage.specs import make_cache_spec
from kvpage.specs.state import StateSpec

BS = 16
ROW = 48  # bytes of one fake state row
FP = tier_fingerprint({"model": "state-tier-events", "format": 3})


class Rows:
    """A ``SnapshotMover`` over a dict of rows, and a ``BlockMover`` over a dict of
    blocks (this test checks bookkeeping, not content)."""

    slot_nbytes = ROW
    block_nbytes = 32

    def __init__(self) -> None:
        self.rows: dict[int, bytes] = {}
        self.blocks: dict[int, bytes] = {}

    def copy_slots(self, pairs: Sequence[tuple[int, int]]) -> None:
        for a, b in pairs:
            self.rows[b] = self.rows.get(a, bytes(ROW))

    def read_slot(self, slot: int) -> bytes:
        return self.rows.get(slot, bytes(ROW))

    def write_slot(self, slot: int, payload: bytes) -> None:
        self.rows[slot] = bytes(payload)

    def read_blocks(self, ids: Sequence[int]) -> list[bytes]:
        return [self.blocks.get(i, bytes(32)) for i in ids]

    def write_blocks(self, ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        for i, p in zip(ids, payloads):
            self.blocks[i] = bytes(p)


def _replica(
    tmp: Path, *, snaps: int, host_rows: int, disk_rows: int, num_blocks: int = 64
) -> tuple[KVCacheManager, Rows]:
    st_layers = [
        StateSpec(
            kind="gated_deltanet", layer_id=0, conv_dim=8, conv_kernel=2, ssm_shape=(1, 2, 2)
        )  # fmt: skip
    ]
    spec = make_cache_spec(
        num_layers=1, block_size=BS, num_blocks=num_blocks,
        layers=[dict(num_q_heads=2, num_kv_heads=1, head_dim=8)], state_layers=st_layers,
    )  # fmt: skip
    pol = SnapshotPolicy(BS, share_threshold=2, predicted_share=0.5)
    pool = StatePool(2, snaps, pol, num_host_snapshots=host_rows)
    kv = KVCacheManager(spec, state_pool=pool)
    mover = Rows()
    disk = DiskTier(tmp, 64 * 32 + disk_rows * ROW, FP, state_capacity_bytes=disk_rows * ROW)
    kv.attach_tiers(TieredCache(kv.pools[0], mover, host=HostTier(6 * 32), disk=disk))
    pool.attach_disk(disk, mover)
    return kv, mover


def _serve(kv: KVCacheManager, mover: Rows, rid: str, toks: list[int]) -> int:
    """The replica's own lookup, then the request run to its end in the chunks the
    snapshot policy asks for (the scheduler's order: tiers flushed and state copies run
    before each 'forward'); returns the hit in tokens."""
    hit = kv.get_num_cached_tokens(toks)
    done = hit
    while done < len(toks):
        end = kv.state_chunk_end(rid, toks, done, len(toks))
        assert kv.allocate(rid, toks, end - done, num_cached_tokens=hit if done == hit else 0) is not None  # fmt: skip
        assert kv.tiers is not None
        kv.tiers.flush()
        mover.copy_slots(kv.take_state_copies())
        kv.commit(rid, toks, end)
        done = end
    mover.copy_slots(kv.take_state_copies())
    kv.free(rid)
    return hit


def _events(pub: KVEventPublisher) -> list[tuple[str, str, tuple[bytes, ...]]]:
    batch = pub.drain()
    out = []
    for e in () if batch is None else batch.events:
        if isinstance(e, BlockStored):
            out.append(("stored", e.medium, e.block_hashes))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.medium, e.block_hashes))
    return out


def test_eviction_to_host_then_disk_then_hit_as_events(tmp_path: Path) -> None:
    kv, mover = _replica(tmp_path, snaps=1, host_rows=1, disk_rows=4)
    pub = KVEventPublisher("r")
    pub.attach(kv)
    a, b, c = (list(range(s, s + 40)) for s in (3, 100, 200))  # prompt boundary 32
    ha, hb, hc = (hash_request_blocks(t, BS)[1] for t in (a, b, c))
    _serve(kv, mover, "a", a)
    assert ("stored", "state", (ha,)) in _events(pub)
    _serve(kv, mover, "b", b)  # a's snapshot: slot -> host row
    evs = _events(pub)
    i = evs.index
    assert i(("stored", "state_host", (ha,))) < i(("removed", "state", (ha,)))
    assert pub.held("state_host") == {ha} and pub.held("state") == {hb}
    _serve(kv, mover, "c", c)  # b's to the host row, a's to a disk file
    evs = _events(pub)
    assert ("removed", "state_host", (ha,)) in evs and ("stored", "state_disk", (ha,)) in evs
    assert all(not is_state_key(h) for _, m, hs in evs if m == "disk" for h in hs)
    assert pub.held("state_disk") == {ha} and pub.held("state_host") == {hb}
    snap = pub.snapshot()
    assert snap.state_hashes == {hc} and snap.tier_hashes.get("disk", frozenset()).isdisjoint({ha})  # fmt: skip
    assert snap.state_tier_hashes == {"state_host": {hb}, "state_disk": {ha}}
    assert KVSnapshot.from_dict(snap.to_dict()) == snap
    # a hit on a's: promoted from disk into the slot (the file stays); c's to the host,
    # b's to disk
    assert _serve(kv, mover, "a2", a) == 32
    evs = _events(pub)
    assert ("stored", "state", (ha,)) in evs and ("removed", "state_disk", (ha,)) not in evs
    assert pub.held("state_disk") == {ha, hb} and pub.held("state_host") == {hc}
    # a late publisher announces every place
    late = KVEventPublisher("late")
    late.attach(kv)
    media = {m for _, m, _ in _events(late)}
    assert {"state", "state_host", "state_disk"} <= media
    # a hit on c's from the host row: removed from state_host, stored in state (a's,
    # evicted for it while the only row is c's, is already a disk file: touched)
    assert _serve(kv, mover, "c2", c) == 32
    evs = _events(pub)
    j = evs.index
    assert j(("removed", "state_host", (hc,))) < j(("stored", "state", (hc,)))
    assert pub.held("state_host") == frozenset() and pub.held("state") == {hc}
    assert kv.reset_prefix_cache()
    assert pub.held("state_disk") == frozenset() and pub.snapshot().state_tier_hashes == {}


def test_prefix_index_agrees_with_the_replicas_own_lookup(tmp_path: Path) -> None:
    """Random prompts over a few shared prefixes on a replica whose snapshots and KV
    blocks move through every place (1 slot, 2 host rows, 3 disk files; 24 blocks, a
    6-block host tier, a disk tier): before each request the index's matched_media
    (fed only by the replica's events) equals the hit get_num_cached_tokens then
    serves, and every state medium's view equals the pool's; some hits come from a
    host or disk snapshot, which an index of the slot snapshots alone would miss."""
    kv, mover = _replica(tmp_path, snaps=1, host_rows=2, disk_rows=3, num_blocks=24)
    pool = kv.state
    assert pool is not None and pool.disk is not None
    pub = KVEventPublisher("r")
    pub.attach(kv)
    idx = PrefixIndex(clock=lambda: 0.0)
    idx.resync(pub.snapshot())
    rng = random.Random(26)
    prefixes = [[rng.randrange(3, 250) for _ in range(n * BS)] for n in (2, 3, 4, 2)]
    only_slots = 0
    for r in range(60):
        toks = rng.choice(prefixes) + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))]  # fmt: skip
        batch = pub.drain()
        if batch is not None:
            assert idx.apply(batch)
        assert idx.view("r", "state") == set(pool.snapshot_hashes())
        assert idx.view("r", "state_host") == set(pool.host_snapshot_hashes())
        assert idx.view("r", "state_disk") == set(pool.disk_snapshot_hashes())
        assert idx.view("r", "disk") == {h for h in pool.disk.hashes() if not is_state_key(h)}
        hashes = hash_request_blocks(toks, BS)[: (len(toks) - 1) // BS]
        routed = sum(idx.matched_media(hashes)["r"].values())
        snaps = set(pool.snapshot_hashes())
        slot_cut = max((k for k in range(1, routed + 1) if hashes[k - 1] in snaps), default=0)
        hit = _serve(kv, mover, f"q{r}", toks)
        assert routed == hit // BS, (r, routed, hit)
        only_slots += slot_cut < routed
    kv.check_integrity()
    st = pool.stats
    assert st.host_snapshot_hits > 0 and st.disk_snapshot_hits > 0 and only_slots > 0


def test_lookup_promotes_no_kv_past_the_deepest_snapshot(tmp_path: Path) -> None:
    """A hybrid's hit ends at its deepest state snapshot, so a lookup promotes no tier
    KV block past it: with a's snapshot gone (one slot, no host row, no disk room for
    state) and a's KV blocks in the host tier, resending a hits 0 and promotes
    nothing; with its snapshot kept, exactly the hit's blocks come back."""
    kv, mover = _replica(tmp_path, snaps=1, host_rows=0, disk_rows=0, num_blocks=4)
    tiers = kv.tiers
    assert tiers is not None and tiers.host is not None
    a, b = (list(range(s, s + 40)) for s in (3, 100))  # 2 full blocks, boundary 32
    _serve(kv, mover, "a", a)
    _serve(kv, mover, "b", b)  # a's snapshot evicted (nowhere to go), a's KV to the host
    ha = hash_request_blocks(a, BS)
    assert kv.state is not None and not kv.state.has_snapshot(ha[1])
    assert all(h in tiers.host for h in ha[:2])
    # the miss names the KV the tiers hold (not promoted): no state snapshot at 32
    why = kv.explain_miss(a, kv.get_num_cached_tokens(a))
    assert why.reason == "no_state_snapshot" and why.state_position == 32
    other = a[:32] + list(range(150, 170))  # a's 2 blocks, then a third nowhere
    why = kv.explain_miss(other, kv.get_num_cached_tokens(other))
    assert why.reason == "no_state_snapshot" and why.state_position == 32
    assert _serve(kv, mover, "a2", a) == 0
    assert tiers.host.stats.promotions == 0
    kv2, mover2 = _replica(tmp_path / "2", snaps=2, host_rows=0, disk_rows=0, num_blocks=4)
    t2 = kv2.tiers
    assert t2 is not None and t2.host is not None
    _serve(kv2, mover2, "a", a)
    _serve(kv2, mover2, "b", b)  # both snapshots kept; a's KV to the host
    assert _serve(kv2, mover2, "a2", a) == 32
    assert t2.host.stats.promotions == 2
