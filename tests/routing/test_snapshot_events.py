"""Recurrent-state snapshots in the KV event stream (issue 26): a hybrid replica's
StatePool reports snapshots stored and evicted by the hash of their boundary block
(medium "state"), the publisher's KVSnapshot carries them, and the router's
PrefixIndex cuts a hybrid replica's KV match at its deepest snapshot (the engine's
rule), for matched_blocks and matched_media; recurrent-only replicas match the deepest
snapshot along the request."""

from __future__ import annotations

import pytest

from kvpage.cache import KVCacheManager, hash_request_blocks
from kvpage.cache.snapshot_policy import SnapshotPolicy
from kvpage.cache.state_pool import StatePool
from kvpage.routing import KVEventPublisher, PrefixIndex
from kvpage.routing.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
    RoutingError,
    event_from_dict,
    event_to_dict,
)
from kvpage.specs import make_cache_spec
from kvpage.specs.state import StateSpec

BS = 16


def _manager(snaps: int) -> KVCacheManager:
    st_layers = [
        StateSpec(kind="gated_deltanet", layer_id=i, conv_dim=24, conv_kernel=4, ssm_shape=(2, 4, 4))
        for i in (0, 1)
    ]  # fmt: skip
    spec = make_cache_spec(
        num_layers=1, block_size=BS, num_blocks=64,
        layers=[dict(num_q_heads=4, num_kv_heads=2, head_dim=8)], state_layers=st_layers,
    )  # fmt: skip
    pool = StatePool(2, snaps, SnapshotPolicy(BS, share_threshold=9, predicted_share=0.0))
    return KVCacheManager(spec, state_pool=pool)


def _run_prompt(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Admit, compute the prompt in the chunks the snapshot policy asks for (as the
    scheduler does: ``state_chunk_end``), committing after each, finish."""
    done = 0
    while done < len(tokens):
        end = kv.state_chunk_end(rid, tokens, done, len(tokens))
        assert kv.allocate(rid, tokens, end - done) is not None
        kv.commit(rid, tokens, end)
        done = end
    kv.free(rid)


def _events(pub: KVEventPublisher) -> list[tuple[str, str, tuple[bytes, ...]]]:
    batch = pub.drain()
    assert batch is not None
    out = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            out.append(("stored", e.medium, e.block_hashes))
        elif isinstance(e, BlockRemoved):
            out.append(("removed", e.medium, e.block_hashes))
        else:
            out.append(("cleared", "", ()))
    return out


def test_snapshot_stored_and_evicted_events() -> None:
    kv = _manager(snaps=1)
    pub = KVEventPublisher("r0")
    pub.attach(kv)
    a = list(range(3, 43))  # 40 tokens: prompt boundary 32 (block 1)
    b = list(range(100, 140))
    ha, hb = hash_request_blocks(a, BS), hash_request_blocks(b, BS)
    _run_prompt(kv, "a", a)
    evs = _events(pub)
    assert ("stored", "state", (ha[1],)) in evs
    assert ("stored", "device", (ha[0], ha[1])) in evs
    assert pub.held("state") == {ha[1]}
    _run_prompt(kv, "b", b)  # one snapshot slot: a's is evicted for b's
    evs = _events(pub)
    assert evs.index(("removed", "state", (ha[1],))) < evs.index(("stored", "state", (hb[1],)))
    snap = pub.snapshot()
    assert snap.state == "hybrid" and snap.state_hashes == {hb[1]}
    assert snap.tier_hashes == {}  # the state medium is not a KV tier
    assert KVSnapshot.from_dict(snap.to_dict()) == snap
    # a new publisher announces the snapshots already held
    late = KVEventPublisher("r1")
    late.attach(kv)
    assert ("stored", "state", (hb[1],)) in _events(late)
    assert kv.reset_prefix_cache()
    assert _events(pub) == [("cleared", "", ())]
    assert pub.held("state") == frozenset() and pub.snapshot().state_hashes == frozenset()
    pub.detach()
    _run_prompt(kv, "c", a)
    assert pub.drain() is None  # detached from the state pool too


def test_state_events_round_trip_and_are_checked() -> None:
    h = bytes([7]) * 32
    for ev in (BlockStored((h,), None, "state"), BlockRemoved((h,), "state")):
        assert event_from_dict(event_to_dict(ev)) == ev
    with pytest.raises(RoutingError, match="event.medium"):
        event_from_dict({"type": "stored", "block_hashes": [h.hex()], "medium": "ssm"})
    with pytest.raises(RoutingError, match="snapshot.state"):
        KVSnapshot("r", 0, frozenset(), state="mamba")
    with pytest.raises(RoutingError, match="state_hashes"):
        KVSnapshot("r", 0, frozenset(), state_hashes=frozenset({h}))


def H(i: int) -> bytes:
    return bytes([i]) * 32


def test_prefix_index_cuts_a_hybrid_match_at_its_deepest_snapshot() -> None:
    idx = PrefixIndex(clock=lambda: 0.0)
    blocks = frozenset(H(i) for i in range(4))
    idx.resync(KVSnapshot("hyb", 0, blocks, "e", state="hybrid", state_hashes=frozenset({H(1)})))
    idx.resync(KVSnapshot("kv", 0, blocks, "e"))
    idx.resync(KVSnapshot("rec", 0, frozenset(), "e", state="recurrent_only", state_hashes=frozenset({H(2)})))  # fmt: skip
    q = [H(i) for i in range(4)]
    assert idx.matched_blocks(q) == {"hyb": 2, "kv": 4, "rec": 3}
    assert idx.state_kind("hyb") == "hybrid" and idx.view("hyb", "state") == {H(1)}

    def apply(*events: object) -> None:
        seq = idx.seq("hyb")
        assert seq is not None
        assert idx.apply(KVEventBatch("hyb", seq + 1, 0.0, tuple(events), "e"))  # type: ignore[arg-type]

    apply(BlockStored((H(3),), None, "state"))
    assert idx.matched_blocks(q)["hyb"] == 4
    assert idx.matched_blocks(q[:3])["hyb"] == 2  # the snapshot at 4 lies past the query
    apply(BlockRemoved((H(3),), "state"))
    assert idx.matched_blocks(q)["hyb"] == 2
    apply(BlockRemoved((H(1),), "device"))  # KV ends at block 1: no snapshot within it
    assert idx.matched_blocks(q)["hyb"] == 0
    apply(BlockStored((H(1),), None, "device"), BlockStored((H(0),), None, "state"))
    assert idx.matched_blocks(q)["hyb"] == 2
    # tiers: a host block within the run counts; the cut applies to the media counts
    apply(BlockRemoved((H(1),), "device"), BlockStored((H(1),), None, "host"))
    media = idx.matched_media(q)
    assert media["kv"] == {"device": 4}
    assert media["hyb"] == {"device": 1, "host": 1}
    assert media["rec"] == {"device": 3}
    apply(BlockRemoved((H(1),), "state"))
    assert idx.matched_media(q)["hyb"] == {"device": 1}  # cut at the snapshot at 1
    apply(AllBlocksCleared())
    assert idx.matched_blocks(q)["hyb"] == 0 and idx.view("hyb", "state") == frozenset()
