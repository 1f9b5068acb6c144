"""PrefixIndex: in-order application, gaps and restarts force a resync, eviction reaches
the router, dead replicas are removed."""

from __future__ import annotations

from routing_helpers import BS, make_replica, pool_hashes, run_request, sync

from kvpage.cache import hash_request_blocks
from kvpage.routing import (
    KVEventPublisher,
    PrefixIndex,
    ReplicaLoad,
    make_policy,
    route_request,
)


def _loads(*ids: str) -> list[ReplicaLoad]:
    return [ReplicaLoad(i, 0, 0, 0.0) for i in ids]


def test_in_order_batches_apply_and_duplicates_are_dropped() -> None:
    mgr, pub = make_replica("a")
    idx = PrefixIndex()
    idx.resync(pub.snapshot())
    run_request(mgr, "r1", list(range(8)))
    b1 = pub.drain()
    assert b1 is not None and idx.apply(b1)
    assert idx.view("a") == pool_hashes(mgr) and idx.seq("a") == 1
    assert idx.apply(b1)  # a duplicate: already covered, nothing changes
    assert idx.stats.batches_dropped == 1 and idx.stats.batches_applied == 1


def test_gap_refuses_then_resync_restores_the_exact_view() -> None:
    mgr, pub = make_replica("a")
    idx = PrefixIndex()
    idx.resync(pub.snapshot())
    run_request(mgr, "r1", list(range(8)))
    lost = pub.drain()
    assert lost is not None  # dropped in transit
    run_request(mgr, "r2", list(range(20, 28)))
    b2 = pub.drain()
    assert b2 is not None and b2.seq == 2
    assert not idx.apply(b2)  # gap: never applied out of order
    assert idx.stats.gaps == 1 and idx.is_stale("a") and idx.view("a") == frozenset()
    h = hash_request_blocks(list(range(20, 28)), BS)
    assert idx.matched_blocks(h) == {"a": 0}  # a stale view attracts nothing
    idx.resync(pub.snapshot())
    assert not idx.is_stale("a") and idx.view("a") == pool_hashes(mgr)
    assert idx.matched_blocks(h) == {"a": 2}
    assert idx.apply(lost) and idx.apply(b2)  # both covered by the snapshot: dropped
    run_request(mgr, "r3", list(range(40, 48)))
    sync(idx, pub)
    assert idx.view("a") == pool_hashes(mgr)
    assert idx.stats.resyncs == 1 and idx.stats.joins == 1


def test_restarted_replica_new_epoch_forces_resync() -> None:
    mgr, pub = make_replica("a")
    idx = PrefixIndex()
    idx.resync(pub.snapshot())
    run_request(mgr, "r1", list(range(8)))
    sync(idx, pub)
    assert idx.view("a")
    mgr2, pub2 = make_replica("a")  # the replica restarted: empty cache, seq back at 1
    run_request(mgr2, "r9", list(range(60, 68)))
    b = pub2.drain()
    assert b is not None and b.seq == 1
    assert not idx.apply(b) and idx.stats.unknown == 1
    assert idx.matched_blocks(hash_request_blocks(list(range(8)), BS)) == {"a": 0}
    idx.resync(pub2.snapshot())
    assert idx.epoch("a") == pub2.epoch and idx.view("a") == pool_hashes(mgr2)


def test_unknown_replica_is_refused_until_resync() -> None:
    _, pub = make_replica("new")
    idx = PrefixIndex()
    b = KVEventPublisher("new")
    assert b.drain() is None
    mgr, pub = make_replica("new")
    run_request(mgr, "r1", list(range(8)))
    batch = pub.drain()
    assert batch is not None and not idx.apply(batch) and "new" not in idx


def test_eviction_reaches_the_router_and_stops_attracting_traffic() -> None:
    (ma, pa), (mb, pb) = make_replica("a", num_blocks=4), make_replica("b", num_blocks=4)
    idx = PrefixIndex()
    for p in (pa, pb):
        idx.resync(p.snapshot())
    pol = make_policy("kv_precise", index=idx)
    prompt = list(range(9))  # 2 full blocks + 1 token
    run_request(ma, "r1", prompt)
    sync(idx, pa)
    req = route_request(prompt, block_size=BS)
    assert idx.matched_blocks(req.block_hashes) == {"a": 2, "b": 0}
    assert pol.choose(req, _loads("a", "b")) == "a"
    # replica a serves other content: its cached blocks of the prompt are evicted
    run_request(ma, "r2", list(range(100, 112)))
    sync(idx, pa)
    assert not (set(req.block_hashes) & pool_hashes(ma))
    assert idx.matched_blocks(req.block_hashes) == {"a": 0, "b": 0}
    # now b holds it: traffic follows the blocks
    run_request(mb, "r3", prompt)
    sync(idx, pb)
    assert pol.choose(req, _loads("a", "b")) == "b"


def test_dead_replica_is_removed_at_once() -> None:
    (ma, pa), (mb, pb) = make_replica("a"), make_replica("b")
    idx = PrefixIndex()
    prompt = list(range(8))
    for m, p in ((ma, pa), (mb, pb)):
        idx.resync(p.snapshot())
        run_request(m, "r", prompt)
        sync(idx, p)
    h = hash_request_blocks(prompt, BS)
    assert idx.matched_blocks(h) == {"a": 2, "b": 2}
    pol = make_policy("kv_precise", index=idx)
    pol.forget("a")
    assert idx.matched_blocks(h) == {"b": 2} and idx.replicas == ["b"]
    assert idx.view("a") == frozenset() and idx.stats.removals == 1
    assert not idx.remove("a")
    batch = pa.drain()
    assert batch is None or not idx.apply(batch)  # a late batch of the dead one is refused


def test_matched_blocks_counts_leading_run_only_and_lag() -> None:
    now = [10.0]
    idx = PrefixIndex(clock=lambda: now[0])
    mgr, pub = make_replica("a")
    pub._clock = lambda: 9.5  # batch drained at t=9.5, applied at t=10
    idx.resync(pub.snapshot())
    run_request(mgr, "r1", list(range(12)))
    sync(idx, pub)
    assert idx.stats.last_lag_s == 0.5
    h = hash_request_blocks(list(range(12)), BS)
    other = hash_request_blocks([99] * 4 + list(range(4, 12)), BS)
    assert idx.matched_blocks(h) == {"a": 3}
    assert idx.matched_blocks(h[:2]) == {"a": 2}
    assert idx.matched_blocks(other) == {"a": 0}  # blocks 1, 2 differ by the chain
    assert idx.matched_blocks([]) == {"a": 0}
