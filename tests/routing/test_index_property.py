"""Property: after any interleaving of allocations, commits, frees, evictions, prefix-cache
resets and event deliveries on real KVCacheManagers (deliveries may be dropped, which forces
a resync), the router's view of each replica equals that replica's pool hash map; with KV
tiers below the pools, also each tier's contents (medium "host" / "disk")."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st
from routing_helpers import (
    BS,
    make_replica,
    make_tiered_replica,
    pool_hashes,
    sync,
    tier_hashes,
)

from kvpage.routing import PrefixIndex
from kvpage.sim.tiers import SimDiskTier

REPLICAS = ("r0", "r1", "r2")
# prompts from a few shared stems, so replicas share and evict prefixes
STEMS = [list(range(s, s + 3 * BS)) for s in (0, 100, 200)]

op = st.one_of(
    st.tuples(st.just("start"), st.integers(0, 2), st.integers(0, 2), st.integers(1, 12)),
    st.tuples(st.just("free"), st.integers(0, 2), st.integers(0, 30)),
    st.tuples(st.just("deliver"), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("reset"), st.integers(0, 2)),
)


@given(st.lists(op, max_size=60))
@example([("start", 0, 0, 1), ("deliver", 0, False)])  # the last batch is lost
@example(
    [("start", 1, 0, 4), ("deliver", 1, True), ("free", 1, 0), ("reset", 1), ("start", 1, 1, 9)]
)
def test_view_equals_pool_hash_map_after_any_interleaving(ops: list[tuple]) -> None:
    _check(ops, tiers=False)


@given(st.lists(op, max_size=60))
@example([("start", 0, 0, 1), ("start", 0, 1, 9), ("start", 0, 2, 9), ("deliver", 0, True)])
@example([("start", 2, 0, 8), ("start", 2, 1, 8), ("deliver", 2, True), ("reset", 2)])
def test_views_equal_pool_and_tiers_after_any_interleaving(ops: list[tuple]) -> None:
    _check(ops, tiers=True)


def _check(ops: list[tuple], tiers: bool) -> None:
    if tiers:  # host of 3 blocks, an in-memory disk tier of 5 (payloads are 8 bytes)
        reps = {
            rid: make_tiered_replica(rid, 10, 3, SimDiskTier(5 * 8) if rid != "r1" else None)
            for rid in REPLICAS
        }
    else:
        reps = {rid: make_replica(rid, num_blocks=10) for rid in REPLICAS}
    idx = PrefixIndex()
    for _, pub in reps.values():
        idx.resync(pub.snapshot())
    live: dict[str, list[str]] = {rid: [] for rid in REPLICAS}
    n = 0
    for o in ops:
        rid = REPLICAS[o[1]]
        mgr, pub = reps[rid]
        if o[0] == "start":
            n += 1
            toks = STEMS[o[2]] + [1000 + n] * o[3]
            hit = mgr.get_num_cached_tokens(toks)
            if mgr.allocate(f"q{n}", toks, len(toks) - hit, num_cached_tokens=hit) is None:
                continue
            mgr.commit(f"q{n}", toks, len(toks))
            live[rid].append(f"q{n}")
        elif o[0] == "free" and live[rid]:
            mgr.free(live[rid].pop(o[2] % len(live[rid])))
        elif o[0] == "deliver":
            batch = pub.drain()
            # delivered (o[2]) or dropped in transit; a refused batch forces a resync
            if batch is not None and o[2] and not idx.apply(batch):
                idx.resync(pub.snapshot())
        elif o[0] == "reset":
            mgr.reset_prefix_cache()  # no-op (False) while a request holds blocks
    for rid, (mgr, pub) in reps.items():
        sync(idx, pub)
        # the heartbeat in sync() turns a lost last batch into a gap -> resync
        assert idx.view(rid) == pool_hashes(mgr) == pub.held(), rid
        for m in ("host", "disk"):
            assert idx.view(rid, m) == tier_hashes(mgr, m) == pub.held(m), (rid, m)
        assert not idx.is_stale(rid)
        mgr.check_integrity()
