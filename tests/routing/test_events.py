"""KV events: order, sequence numbers, coalescing, the JSON form, attach and clear."""

from __future__ import annotations

import pytest
from routing_helpers import BS, make_manager, make_replica, pool_hashes, run_request

from kvpage.cache import hash_request_blocks
from kvpage.routing import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    KVSnapshot,
    RoutingError,
)


def test_seq_starts_at_1_and_grows_by_one_none_when_idle() -> None:
    mgr, pub = make_replica("a")
    assert pub.drain() is None and pub.seq == 0
    toks = list(range(8))
    run_request(mgr, "r1", toks)
    b1 = pub.drain()
    assert b1 is not None and b1.seq == 1 and b1.replica_id == "a" and b1.epoch == pub.epoch
    assert b1.events == (BlockStored(tuple(hash_request_blocks(toks, BS))),)
    assert pub.drain() is None  # nothing new: no seq used
    run_request(mgr, "r2", list(range(100, 108)))
    b2 = pub.drain()
    assert b2 is not None and b2.seq == 2


def test_eviction_is_a_block_removed_in_pool_order() -> None:
    mgr, pub = make_replica("a", num_blocks=3)  # 2 usable blocks
    first = list(range(8))
    run_request(mgr, "r1", first)
    second = list(range(50, 58))
    run_request(mgr, "r2", second)  # evicts both blocks of r1 (LRU: last block first)
    b = pub.drain()
    assert b is not None
    h1, h2 = hash_request_blocks(first, BS), hash_request_blocks(second, BS)
    kinds = [type(e) for e in b.events]
    assert kinds == [BlockStored, BlockRemoved, BlockStored]
    assert set(b.events[1].block_hashes) == set(h1)  # type: ignore[union-attr]
    assert b.events[2].block_hashes == tuple(h2)  # type: ignore[union-attr]
    assert pub.held() == pool_hashes(mgr) == frozenset(h2)


def test_clear_overrides_pending_events() -> None:
    mgr, pub = make_replica("a")
    run_request(mgr, "r1", list(range(8)))
    assert mgr.reset_prefix_cache()
    b = pub.drain()
    assert b is not None and b.events == (AllBlocksCleared(),)
    assert pub.snapshot().block_hashes == frozenset()


def test_attach_announces_blocks_already_cached() -> None:
    mgr = make_manager()
    run_request(mgr, "r1", list(range(8)))
    pub = KVEventPublisher("late")
    pub.attach(mgr)
    b = pub.drain()
    assert b is not None and b.seq == 1
    assert set(b.events[0].block_hashes) == pool_hashes(mgr)  # type: ignore[union-attr]
    with pytest.raises(Exception, match="attach"):
        pub.attach(mgr)


def test_epoch_differs_per_publisher_and_detach_stops_events() -> None:
    mgr, pub = make_replica("a")
    assert KVEventPublisher("a").epoch != pub.epoch
    pub.detach()
    run_request(mgr, "r1", list(range(8)))
    assert pub.drain() is None


def test_to_dict_from_dict_round_trip() -> None:
    h = bytes(range(32))
    batch = KVEventBatch(
        "r0", 3, 12.5, (BlockStored((h, h[::-1]), h), BlockRemoved((h,)), AllBlocksCleared()), "ep"
    )
    d = batch.to_dict()
    assert d["events"][0]["block_hashes"][0] == h.hex()
    assert KVEventBatch.from_dict(d) == batch
    snap = KVSnapshot("r0", 3, frozenset({h}), "ep")
    assert KVSnapshot.from_dict(snap.to_dict()) == snap


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"replica_id": "a", "seq": 1, "ts": 0.0, "events": [{"type": "moved"}]},
        {"replica_id": "a", "seq": "1", "ts": 0.0, "events": []},
        {
            "replica_id": "a",
            "seq": 1,
            "ts": 0.0,
            "events": [{"type": "removed", "block_hashes": ["zz"]}],
        },
        {"replica_id": "a", "seq": 1, "ts": 0.0, "events": "x"},
    ],
)
def test_from_dict_refuses_malformed_batches(bad: object) -> None:
    with pytest.raises(RoutingError):
        KVEventBatch.from_dict(bad)  # type: ignore[arg-type]


def test_hybrid_model_publishes_the_full_attention_pool() -> None:
    # one full, one sliding group; the bytes of 6 blocks per group in the unified pool
    mgr = make_manager(num_blocks=11, windows=(None, 4))
    assert mgr.num_groups == 2 and mgr.prefix_pools == [mgr.pools[0]]
    pub = KVEventPublisher("h")
    pub.attach(mgr)
    for i in range(4):  # enough traffic to evict in both pools
        run_request(mgr, f"r{i}", list(range(10 * i, 10 * i + 12)))
    b = pub.drain()
    assert b is not None and pub.held() == mgr.pools[0].cached_hashes()
    assert any(isinstance(e, BlockRemoved) for e in b.events)


def test_two_full_pools_a_hash_counts_while_both_hold_it() -> None:
    from types import SimpleNamespace

    from kvpage.cache import BlockPool

    p0, p1 = BlockPool(4), BlockPool(4)
    pub = KVEventPublisher("two")
    pub.attach(SimpleNamespace(prefix_pools=[p0, p1]))  # type: ignore[arg-type]
    h = bytes(32)
    b0, b1 = p0.allocate(1)[0], p1.allocate(1)[0]
    p0.cache_block(b0, h)
    assert pub.held() == frozenset() and pub.drain() is None  # only one pool holds it
    p1.cache_block(b1, h)
    assert pub.held() == {h}
    p0.free([b0])
    p0.allocate(3)  # the LRU queue reaches b0: evicted in pool 0 only
    b = pub.drain()
    assert b is not None and b.events == (BlockStored((h,)), BlockRemoved((h,)))
    assert pub.held() == frozenset()
