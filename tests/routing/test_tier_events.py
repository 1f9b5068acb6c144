"""KV events of the KV tiers: the medium field (wire form, backward compatibility), the
publisher on real tiers (demotion, promotion, drops, clear, restart of the disk tier),
the index's per-medium views and kv_precise's weighting of tier hits."""

from __future__ import annotations

from pathlib import Path

import pytest
from routing_helpers import BS, make_tiered_replica, pool_hashes, run_request, sync, tier_hashes

from kvpage.cache import hash_request_blocks
from kvpage.cache.tier_store import DiskTier, tier_fingerprint
from kvpage.routing import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CostWeights,
    KVEventBatch,
    KVSnapshot,
    PrefixIndex,
    ReplicaLoad,
    RouteRequest,
    RoutingError,
    make_policy,
)
from kvpage.routing.events import event_from_dict, event_to_dict

A = list(range(100, 100 + 3 * BS + 1))  # 3 full blocks + 1 token
B = list(range(200, 200 + 3 * BS + 1))
C = list(range(300, 300 + 3 * BS + 1))
FP = tier_fingerprint({"model": "routing-test", "block_size": BS})


def blocks(tokens: list[int]) -> list[bytes]:
    return hash_request_blocks(tokens, BS)


def test_medium_round_trips_and_defaults_to_device() -> None:
    h = (b"\x01" * 32, b"\x02" * 32)
    for ev in (BlockStored(h, None, "host"), BlockRemoved(h, "disk"), BlockStored(h)):
        assert event_from_dict(event_to_dict(ev)) == ev
    old = {"type": "removed", "block_hashes": [x.hex() for x in h]}  # before tiers
    assert event_from_dict(old) == BlockRemoved(h, "device")
    with pytest.raises(RoutingError, match="event.medium: expected one of"):
        event_from_dict({**old, "medium": "gpu"})
    snap = KVSnapshot("r", 3, frozenset(h[:1]), "e", {"host": frozenset(h[1:])})
    assert KVSnapshot.from_dict(snap.to_dict()) == snap
    d = snap.to_dict()
    del d["tier_hashes"]
    assert KVSnapshot.from_dict(d).tier_hashes == {}
    with pytest.raises(RoutingError, match="snapshot.tier_hashes: expected keys"):
        KVSnapshot.from_dict({**snap.to_dict(), "tier_hashes": {"device": []}})


def test_demotion_promotion_and_host_drop_are_published_with_their_medium() -> None:
    # pool of 4 usable blocks, host tier of 3 blocks, no disk
    mgr, pub = make_tiered_replica("r0", num_blocks=5, host_blocks=3)
    a = blocks(A)
    assert run_request(mgr, "a", A)
    pub.drain()
    assert run_request(mgr, "b", B)  # evicts A's blocks: device -> host
    evs = pub.drain()
    assert evs is not None
    removed_dev = {
        h
        for e in evs.events
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
        if e.medium == "device"
    }
    stored_host = {
        h
        for e in evs.events
        if isinstance(e, BlockStored)
        for h in e.block_hashes
        if e.medium == "host"
    }
    assert removed_dev & set(a) and stored_host == removed_dev
    assert pub.held("host") == tier_hashes(mgr, "host") == stored_host
    # A again: its host blocks are promoted (host and pool exclusive: removed from host)
    assert run_request(mgr, "a2", A)
    evs = pub.drain()
    assert evs is not None
    removed_host = {
        h
        for e in evs.events
        if isinstance(e, BlockRemoved) and e.medium == "host"
        for h in e.block_hashes
    }
    assert stored_host & set(a) <= removed_host
    assert pub.held() == pool_hashes(mgr)
    assert pub.held("host") == tier_hashes(mgr, "host")
    # C pushes more into the 3-block host tier: its LRU drops are removals of "host"
    assert run_request(mgr, "c", C)
    assert pub.held("host") == tier_hashes(mgr, "host")
    assert len(pub.held("host")) <= 3


def test_index_follows_tiers_and_clear_empties_every_medium() -> None:
    mgr, pub = make_tiered_replica("r0", num_blocks=5, host_blocks=3)
    idx = PrefixIndex()
    idx.resync(pub.snapshot())
    for rid, toks in (("a", A), ("b", B)):
        assert run_request(mgr, rid, toks)
        sync(idx, pub)
        assert idx.view("r0") == pool_hashes(mgr)
        assert idx.view("r0", "host") == tier_hashes(mgr, "host")
    assert idx.has_tiers and idx.num_blocks("r0", "host") > 0
    # A is in the host tier only: matched_blocks (device) says 0, matched_media counts it
    assert idx.matched_blocks(blocks(A)) == {"r0": 0}
    per = idx.matched_media(blocks(A))["r0"]
    assert per.get("host", 0) >= 1 and "device" not in per
    assert mgr.reset_prefix_cache()
    batch = pub.drain()
    assert batch is not None and AllBlocksCleared() in batch.events
    assert idx.apply(batch)
    assert idx.view("r0") == idx.view("r0", "host") == frozenset() == tier_hashes(mgr, "host")
    assert not idx.has_tiers


def test_disk_tier_events_and_restart_announces_surviving_files(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 16 * 8, FP)
    mgr, pub = make_tiered_replica("r0", num_blocks=5, host_blocks=0, disk=disk)
    idx = PrefixIndex()
    idx.resync(pub.snapshot())
    assert run_request(mgr, "a", A) and run_request(mgr, "b", B)
    sync(idx, pub)
    on_disk = tier_hashes(mgr, "disk")
    assert on_disk and idx.view("r0", "disk") == on_disk
    # a disk promotion keeps the file: the disk view does not change
    assert run_request(mgr, "a2", A)
    sync(idx, pub)
    assert idx.view("r0", "disk") == tier_hashes(mgr, "disk") >= on_disk & set(blocks(A))
    # a restarted replica over the same directory announces the files in its first batch
    mgr2, pub2 = make_tiered_replica("r0", 5, 0, DiskTier(tmp_path, 16 * 8, FP))
    first = pub2.drain()
    assert first is not None
    assert first.events == (BlockStored(tuple(first.events[0].block_hashes), None, "disk"),)  # type: ignore[union-attr]
    assert idx.apply(first) is False  # new epoch: resync
    idx.resync(pub2.snapshot())
    assert idx.view("r0", "disk") == tier_hashes(mgr2, "disk") == tier_hashes(mgr, "disk")
    assert idx.view("r0") == frozenset()


def test_kv_precise_weighs_tier_hits_below_device_hits() -> None:
    w = CostWeights()
    assert 0 < w.disk < w.host < 1
    # the documented default: Llama-3-8B 2 MiB blocks, host 25 GB/s, disk 6 GB/s, 37k tok/s
    assert CostWeights.tier_weight(2 * 2**20, 25e9, 16, 37e3) == pytest.approx(0.8, abs=0.02)
    assert CostWeights.tier_weight(2 * 2**20, 6e9, 16, 37e3) == pytest.approx(0.2, abs=0.02)
    with pytest.raises(RoutingError, match="cost.host: expected a number < 1"):
        CostWeights(host=1.0)
    h = blocks(A)  # 3 blocks
    idx = PrefixIndex()
    for rid in ("dev", "host", "disk", "none"):
        idx.resync(KVSnapshot(rid, 0, frozenset(), "e"))
    idx.apply(KVEventBatch("dev", 1, 0.0, (BlockStored(tuple(h)),), "e"))
    idx.apply(
        KVEventBatch(
            "host",
            1,
            0.0,
            (BlockStored(tuple(h[:1])), BlockStored(tuple(h[1:]), None, "host")),
            "e",
        )
    )
    idx.apply(KVEventBatch("disk", 1, 0.0, (BlockStored(tuple(h), None, "disk"),), "e"))
    assert idx.matched_media(h) == {
        "dev": {"device": 3},
        "host": {"device": 1, "host": 2},
        "disk": {"disk": 3},
        "none": {},
    }
    pol = make_policy("kv_precise", index=idx)
    req = RouteRequest(prompt_token_ids=A, block_hashes=h, block_size=BS)
    loads = [ReplicaLoad(r, 0, 0, 0.0) for r in ("dev", "host", "disk", "none")]
    sc = pol.scores(req, loads)  # type: ignore[attr-defined]
    assert sc["dev"] == pytest.approx(0.0)
    assert sc["host"] == pytest.approx(3 - (1 + 2 * w.host))
    assert sc["disk"] == pytest.approx(3 - 3 * w.disk)
    assert sc["none"] == pytest.approx(3.0)
    assert pol.choose(req, loads) == "dev"
    assert pol.choose(req, loads[1:]) == "host"
    # without tier events the device count is used exactly as before
    idx2 = PrefixIndex()
    idx2.resync(KVSnapshot("x", 0, frozenset(h[:2]), "e"))
    assert not idx2.has_tiers
    sc2 = make_policy("kv_precise", index=idx2).scores(req, [ReplicaLoad("x", 0, 0, 0.0)])  # type: ignore[attr-defined]
    assert sc2["x"] == pytest.approx(1.0)
