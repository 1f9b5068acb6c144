"""Recurrent state slots (kvpage.cache.state_pool) and their use by KVCacheManager:
live slots, snapshots keyed by block hash, eviction, the state-aware prefix hit, chunk
ends at snapshot boundaries, the no_state_snapshot explanation; a Hypothesis state
machine that tracks what every slot holds, and one with host snapshot rows and real
state tensors (eviction to the host, promotion, host LRU, contents)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvpage.attention.state import StateCache, run_slot_copies
from kvpage.cache import KVCacheManager, KVRetention, hash_request_blocks
from kvpage.cache.free_queue import PRIORITY_HIGH
from kvpage.cache.snapshot_policy import SnapshotPolicy
from kvpage.cache.state_pool import StatePool
from kvpage.capacity import host_snapshot_rows
from kvpage.errors import AllocationError, IntegrityError, SpecError
from kvpage.specs import CacheSpec, make_cache_spec
from kvpage.specs.state import StateSpec

BS = 16


def hybrid_spec(num_blocks: int = 64, bs: int = BS) -> CacheSpec:
    layers = [dict(num_q_heads=4, num_kv_heads=2, head_dim=8)]
    st_layers = [
        StateSpec(
            kind="gated_deltanet", layer_id=i, conv_dim=24, conv_kernel=4, ssm_shape=(2, 4, 4)
        )
        for i in (0, 1, 2)
    ]
    return make_cache_spec(
        num_layers=1, block_size=bs, num_blocks=num_blocks, layers=layers, state_layers=st_layers
    )


def make_manager(
    live: int = 4, snaps: int = 8, *, threshold: int = 2, share: float = 0.25, **kw: object
) -> KVCacheManager:
    pol = SnapshotPolicy(BS, share_threshold=threshold, predicted_share=share)
    return KVCacheManager(hybrid_spec(), state_pool=StatePool(live, snaps, pol), **kw)  # type: ignore[arg-type]


def H(i: int) -> bytes:
    return bytes([i]) * 32


def test_live_slots_allocate_free_fork() -> None:
    p = StatePool(2, 3, SnapshotPolicy(BS))
    assert p.num_slots == 5
    a = p.allocate_live("a")
    b = p.allocate_live("b")
    assert {a, b} == {0, 1} and p.allocate_live("c") is None
    with pytest.raises(AllocationError):
        p.allocate_live("a")
    with pytest.raises(AllocationError, match="free live"):
        p.fork_live("a", "c")
    p.free_live("b")
    c = p.fork_live("a", "c")
    assert c == b and p.take_copies() == [(a, c)]
    with pytest.raises(AllocationError):
        p.free_live("zz")
    p.check_integrity(["a", "c"])
    with pytest.raises(IntegrityError):
        p.check_integrity(["a"])


def test_snapshots_lru_priority_and_predicted_cap() -> None:
    now = [0.0]
    p = StatePool(1, 4, SnapshotPolicy(BS, predicted_share=0.5), clock=lambda: now[0])
    assert p.predicted_cap == 2
    p.allocate_live("r")
    slots = [p.take("r", H(i), "prompt") for i in range(4)]
    assert sorted(slots) == [1, 2, 3, 4]  # type: ignore[type-var]
    assert p.take_copies() == [(0, s) for s in slots]  # type: ignore[misc]
    p.restore("r", H(0))  # H(0) most recently used now
    assert p.take_copies() == [(slots[0], 0)]  # type: ignore[list-item]
    p.take("r", H(5), "prompt")  # evicts the LRU: H(1)
    assert not p.has_snapshot(H(1)) and p.has_snapshot(H(0))
    # a retained entry outlives older default ones until its ttl passes
    p.take("r", H(2), "prompt", priority=PRIORITY_HIGH, ttl_s=10.0)  # existing: raised
    p.take("r", H(6), "prompt")  # H(3) goes (H(2) retained)
    assert p.has_snapshot(H(2)) and not p.has_snapshot(H(3))
    now[0] = 11.0  # H(2) expired: plain LRU again (else H(6) would go last)
    for i in (7, 8, 9):
        p.take("r", H(i), "prompt")  # evicts H(0), H(5), then H(2)
    assert not p.has_snapshot(H(2)) and p.has_snapshot(H(6))
    # predicted ones hold at most the cap; their own LRU goes first
    p.take("r", H(10), "predicted")
    p.take("r", H(11), "predicted")
    assert p.num_predicted == 2
    p.take("r", H(12), "predicted")
    assert not p.has_snapshot(H(10)) and p.num_predicted == 2
    p.take("r", H(11), "prompt")  # wanted for itself now: no longer counted predicted
    assert p.num_predicted == 1
    p.check_integrity(["r"])
    assert p.stats.snapshot_evictions == 8 and p.stats.snapshot_hits == 1
    with pytest.raises(AllocationError):
        p.restore("r", H(99))


def test_rolling_decode_snapshot_replaced_and_zero_slots_skip() -> None:
    p = StatePool(1, 4, SnapshotPolicy(BS))
    p.allocate_live("r")
    p.take("r", H(1), "decode")
    p.take("r", H(2), "decode")
    assert not p.has_snapshot(H(1)) and p.has_snapshot(H(2))
    assert p.stats.snapshots_dropped == 1
    p.free_live("r")  # the last one stays, without an owner
    assert p.entry(H(2)) is not None and p.entry(H(2)).owner is None  # type: ignore[union-attr]
    p.check_integrity([])
    q = StatePool(1, 0, SnapshotPolicy(BS))
    q.allocate_live("r")
    assert q.take("r", H(1), "prompt") is None and q.stats.snapshots_skipped == 1
    with pytest.raises(SpecError):
        StatePool(0, 1, SnapshotPolicy(BS))
    with pytest.raises(SpecError):
        StatePool(1, -1, SnapshotPolicy(BS))


def test_manager_requires_pool_exactly_for_state_layers() -> None:
    with pytest.raises(SpecError, match="state_pool"):
        KVCacheManager(hybrid_spec())
    dense = make_cache_spec(
        num_layers=1,
        block_size=BS,
        num_blocks=8,
        layers=[dict(num_q_heads=2, num_kv_heads=2, head_dim=8)],
    )
    with pytest.raises(SpecError, match="state_pool"):
        KVCacheManager(dense, state_pool=StatePool(1, 1, SnapshotPolicy(BS)))
    with pytest.raises(SpecError, match="block_size"):
        KVCacheManager(hybrid_spec(), state_pool=StatePool(1, 1, SnapshotPolicy(8)))
    only_state = make_cache_spec(
        num_layers=0,
        block_size=BS,
        num_blocks=8,
        layers=[],
        state_layers=list(hybrid_spec().state_layers),
    )
    m = KVCacheManager(only_state, state_pool=StatePool(1, 2, SnapshotPolicy(BS)))
    assert m.num_groups == 0 and m.max_request_tokens == 1 << 40 and m.usage == 0.0
    toks = list(range(40))
    _run_prefill(m, "r", toks)  # snapshot at 32, no KV block anywhere
    m.free("r")
    assert m.get_num_cached_tokens(toks + [1, 2]) == 32
    m.check_integrity()


def _run_prefill(m: KVCacheManager, rid: str, toks: list[int], budget: int = 4096) -> list[int]:
    """Prefill ``toks`` through the manager as the scheduler does; returns the chunk
    ends."""
    cached = m.get_num_cached_tokens(toks)
    start, ends = cached, []
    while start < len(toks):
        end = m.state_chunk_end(rid, toks, start, min(len(toks), start + budget))
        kw = {"num_cached_tokens": cached} if not m.has_request(rid) else {}
        assert m.allocate(rid, toks, end - start, **kw) is not None  # type: ignore[arg-type]
        m.commit(rid, toks, end)
        ends.append(end)
        start = end
    return ends


def test_system_prompt_hits_at_96_for_another_question() -> None:
    m = make_manager()
    system = list(range(1000, 1100))  # 100 tokens
    a = system + [1, 2, 3, 4, 5]
    assert _run_prefill(m, "a", a) == [96, 105]  # chunk cut at the prompt boundary
    copies = m.take_state_copies()
    live_a = m.state_slot("a")
    assert len(copies) == 1 and copies[0][0] == live_a
    m.free("a")
    b = system + [7, 8, 9, 10, 11, 12, 13]
    assert m.get_num_cached_tokens(b) == 96
    _run_prefill(m, "b", b)
    got = m.take_state_copies()
    assert got[0] == (copies[0][1], m.state_slot("b"))  # the restore of block 6's snapshot
    st = m.state.stats  # type: ignore[union-attr]
    assert st.snapshot_hits == 1 and m.stats.prefix_hits_tokens == 96
    m.free("b")
    m.check_integrity()
    assert m.state.num_live_used == 0  # type: ignore[union-attr]


def test_kv_without_snapshot_explains_no_state_snapshot() -> None:
    m = make_manager(threshold=5)
    a = list(range(200, 270))  # 70 tokens: snapshot at 64
    _run_prefill(m, "a", a)
    m.free("a")
    b = a[:50] + [9] * 30  # shares blocks 0..2 (48 tokens) in KV, snapshot only at 64
    hit = m.get_num_cached_tokens(b)
    assert hit == 0
    why = m.explain_miss(b, hit)
    assert why.reason == "no_state_snapshot"
    assert why.state_position == 48 and why.state_nearest is None
    assert why.message == "no state snapshot at position 48 (nearest none)"
    # a request sharing 64 tokens hits there; one sharing 80 (a's is 70) cannot
    c = a[:64] + [3] * 20
    assert m.get_num_cached_tokens(c) == 64
    assert m.explain_miss(c, 64).reason != "no_state_snapshot"


def test_predicted_boundary_taken_for_the_second_request_hit_by_the_third() -> None:
    m = make_manager(threshold=2, share=0.5)
    system = list(range(5000, 5100))
    qs = [[i] * 30 for i in (1, 2, 3)]
    ends = []
    for i, q in enumerate(qs):
        toks = system + q
        ends.append(_run_prefill(m, f"r{i}", toks))
        m.take_state_copies()
        m.free(f"r{i}")
    assert ends[0] == [128, 130]
    assert ends[1] == [96, 128, 130]  # 96 predicted shared (2 passes): cut there
    assert m.state.stats.snapshots_taken_by_kind == {"prompt": 3, "predicted": 1}  # type: ignore[union-attr]
    assert m.get_num_cached_tokens(system + [4] * 30) == 96


def test_decode_rolls_to_last_full_block_and_next_turn_hits() -> None:
    m = make_manager()
    toks = list(range(300, 340))  # 40: prompt boundary 32
    _run_prefill(m, "t1", toks)
    for i in range(30):  # decode 30 tokens: computed 40 .. 70
        toks.append(900 + i)
        assert m.allocate("t1", toks, 1) is not None
        m.commit("t1", toks, len(toks))
    st = m.state.stats  # type: ignore[union-attr]
    assert st.snapshots_taken_by_kind == {"prompt": 1, "decode": 2}  # 48 then 64
    assert st.snapshots_dropped == 1
    m.free("t1")
    turn2 = toks + [1, 2, 3, 4, 5]
    assert m.get_num_cached_tokens(turn2) == 64
    m.check_integrity()


def test_retention_priority_reaches_snapshots_and_truncate_refused() -> None:
    m = make_manager(live=2, snaps=1)
    keep = list(range(40))
    m.get_num_cached_tokens(keep)
    m.allocate("k", keep, 40)
    m.set_retention("k", KVRetention.from_dict({"ranges": [{"start": 0, "priority": 2}]}), 40)
    m.commit("k", keep, 32)
    assert m.state.entry(m.state.snapshot_hashes()[0]).priority == PRIORITY_HIGH  # type: ignore[union-attr]
    with pytest.raises(AllocationError, match="recurrent"):
        m.truncate("k", 33)
    m.free("k")


class StateMachine(RuleBasedStateMachine):
    """Drives a hybrid KVCacheManager like the scheduler (chunked prefill cut at
    state_chunk_end, decode, free, preemption), runs the queued slot copies in order
    before each "forward", and records what each slot holds: the token prefix whose
    state it is. Checks every restored state is the hit's prefix, every snapshot holds
    the prefix its key hashes, and the slot/KV invariants."""

    @initialize(
        live=st.integers(1, 3), snaps=st.integers(0, 5), share=st.sampled_from([0.0, 0.5, 1.0])
    )
    def setup(self, live: int, snaps: int, share: float) -> None:
        pol = SnapshotPolicy(BS, share_threshold=2, predicted_share=share)
        self.m = KVCacheManager(hybrid_spec(num_blocks=40), state_pool=StatePool(live, snaps, pol))
        self.slot: dict[int, tuple[int, ...]] = {}
        self.reqs: dict[str, list[int]] = {}  # running: tokens
        self.done: dict[str, int] = {}  # computed tokens
        self.n = 0
        self.by_hash: dict[bytes, tuple[int, ...]] = {}

    def _forward(self, rid: str, start: int, end: int) -> None:
        for src, dst in self.m.take_state_copies():
            self.slot[dst] = self.slot.get(src, ("?",))  # type: ignore[arg-type]
        s = self.m.state_slot(rid)
        toks = self.reqs[rid]
        if start:
            assert self.slot.get(s) == tuple(toks[:start]), "live state is not the prefix"
        self.slot[s] = tuple(toks[:end])
        self.m.commit(rid, toks, end)
        self.done[rid] = end
        for i, h in enumerate(hash_request_blocks(toks[:end], BS)):
            self.by_hash[h] = tuple(toks[: (i + 1) * BS])

    @rule(
        prefix=st.sampled_from([0, 20, 40, 70]), tail=st.integers(1, 40), budget=st.integers(1, 64)
    )
    def admit(self, prefix: int, tail: int, budget: int) -> None:
        rid = f"r{self.n}"
        self.n += 1
        toks = list(range(prefix)) + [10_000 + 100 * self.n + i for i in range(tail)]
        cached = self.m.get_num_cached_tokens(toks)
        end = self.m.state_chunk_end(rid, toks, cached, min(len(toks), cached + budget))
        if self.m.allocate(rid, toks, end - cached, num_cached_tokens=cached) is None:
            return
        self.reqs[rid] = toks
        self._forward(rid, cached, end)

    @rule(data=st.data(), budget=st.integers(1, 64))
    def step(self, data: st.DataObject, budget: int) -> None:
        if not self.reqs:
            return
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        toks, start = self.reqs[rid], self.done[rid]
        if start == len(toks):  # decode: sample a token first
            toks.append(20_000 + len(toks))
        end = self.m.state_chunk_end(rid, toks, start, min(len(toks), start + budget))
        if self.m.allocate(rid, toks, end - start) is None:
            self._free(rid)  # preempted by recompute
            return
        self._forward(rid, start, end)

    def _free(self, rid: str) -> None:
        self.m.free(rid)
        del self.reqs[rid], self.done[rid]

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if self.reqs:
            self._free(data.draw(st.sampled_from(sorted(self.reqs))))

    @invariant()
    def slots_hold_their_keys(self) -> None:
        self.m.check_integrity()
        pool = self.m.state
        assert pool is not None
        held = dict(self.slot)  # the queued copies run before the next forward
        for src, dst in pool.pending_copies():
            held[dst] = held.get(src, ("?",))  # type: ignore[arg-type]
        for h in pool.snapshot_hashes():
            slot = pool.snapshot_slot(h)
            assert slot is not None
            assert held.get(slot) == self.by_hash[h], "snapshot holds another state"


StateMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestStateMachine = StateMachine.TestCase


def test_readmission_does_not_count_another_pass() -> None:
    m = make_manager(threshold=2, share=0.5)
    toks = list(range(500, 540))  # 40 tokens: blocks 0, 1
    _run_prefill(m, "r", toks)
    m.free("r")  # preempted: the same request comes back
    _run_prefill(m, "r", toks)
    pol = m.state.policy  # type: ignore[union-attr]
    assert pol.pass_count(hash_request_blocks(toks, BS)[0]) == 1
    m.free("r")
    _run_prefill(m, "s", toks)  # another request: a second pass
    assert pol.pass_count(hash_request_blocks(toks, BS)[0]) == 2


def test_host_snapshots_copy_order_promotion_and_lru() -> None:
    """An evicted snapshot's slot is copied to a host row (slot num_slots + row) right
    at eviction, before the copy that reuses the slot; a restore of a host entry
    promotes it (host -> slot after the eviction it causes, its row kept out of that
    eviction), then slot -> live; host rows are least recently used; reset clears."""
    pool = StatePool(2, 1, SnapshotPolicy(BS), num_host_snapshots=1)
    n = pool.num_slots  # 3: live 0, 1; snapshot slot 2; host row 0 is "slot 3"
    pool.allocate_live("a")
    pool.allocate_live("b")
    assert pool.take("a", b"A", "prompt") == 2
    assert pool.take("b", b"B", "prompt") == 2  # evicts A to the host first
    assert pool.take_copies() == [(0, 2), (2, n), (1, 2)]
    assert pool.has_host_snapshot(b"A") and not pool.has_snapshot(b"A")
    assert pool.deepest([b"A"], 1) == 1 and pool.nearest([b"A"], 1) == 1
    pool.free_live("a")
    pool.allocate_live("a")
    pool.restore("a", b"A")  # B goes to the host: the only row is A's, so B is lost
    assert pool.take_copies() == [(n, 2), (2, 0)]
    assert pool.has_snapshot(b"A") and not pool.has_host_snapshot(b"B")
    assert pool.stats.host_snapshot_hits == 1 and pool.stats.host_snapshots_stored == 1
    pool.check_integrity(["a", "b"])
    assert pool.take("b", b"C", "prompt") == 2  # A to the host again (row free now)
    assert pool.take_copies() == [(2, n), (1, 2)] and pool.num_host_used == 1
    pool.take("a", b"D", "prompt")  # C to the host: LRU host row A dropped
    assert pool.has_host_snapshot(b"C") and not pool.has_host_snapshot(b"A")
    assert pool.stats.host_snapshot_evictions == 1
    with pytest.raises(SpecError):
        StatePool(1, 1, SnapshotPolicy(BS), num_host_snapshots=-1)
    pool.free_live("a")
    pool.free_live("b")
    assert pool.reset() and pool.num_host_used == 0
    pool.check_integrity([])


class HostStateMachine(RuleBasedStateMachine):
    """The StatePool with host snapshot rows under a hybrid KVCacheManager, with real
    state tensors (one device ``StateCache`` and one host ``StateCache`` per state
    layer, copies run by ``run_slot_copies`` in queue order before each "forward").
    Each forward writes into the live slot a value that names the token prefix whose
    state it is (per layer: ``id + 1 + 1000 x layer`` in conv, its negative in ssm).
    Snapshots are evicted to host rows (few device slots), hit from the host (a prompt
    re-sent: promotion, then restore), overflow the host rows (LRU) and are freed.

    Checked: a restored live slot holds, in every layer, exactly the state saved for the
    hit's prefix (tensor contents); every device snapshot slot and every host snapshot
    (some host row) holds the state its key hashes; slots and rows each owned once
    (``check_integrity``, distinct slots); host bytes within the budget the rows were
    sized from (``kvpage.capacity.host_snapshot_rows`` of a host tier's bytes); at
    teardown every live slot and block free, and a reset empties slots and rows."""

    @initialize(
        live=st.integers(1, 3),
        snaps=st.integers(1, 3),
        host_tier=st.sampled_from([0, 1, 3, 5]),
        share=st.sampled_from([0.0, 0.5, 1.0]),
    )
    def setup(self, live: int, snaps: int, host_tier: int, share: float) -> None:
        spec = hybrid_spec(num_blocks=40)
        self.S = spec.state_bytes_per_sequence
        # a host KV tier of host_tier x 10 states' bytes, a 0.1 snapshot share of it
        self.host_budget = int(host_tier * 10 * self.S * 0.1)
        rows = host_snapshot_rows(host_tier * 10 * self.S, self.S, 0.1, num_snapshot_slots=snaps)
        assert rows == host_tier
        pol = SnapshotPolicy(BS, share_threshold=2, predicted_share=share)
        self.pool = StatePool(live, snaps, pol, num_host_snapshots=rows)
        self.m = KVCacheManager(spec, state_pool=self.pool)
        cpu = torch.device("cpu")
        self.dev = [StateCache.allocate(s, self.pool.num_slots, cpu) for s in spec.state_layers]
        self.host = [StateCache.allocate(s, rows, cpu) for s in spec.state_layers] if rows else None  # fmt: skip
        self.ids: dict[tuple[int, ...], int] = {(): -1}  # prefix -> id (zeros: none)
        self.prefixes: list[tuple[int, ...]] = []
        self.by_hash: dict[bytes, tuple[int, ...]] = {}
        self.reqs: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}
        self.sent: list[list[int]] = []  # prompts admitted so far
        self.n = 0
        self.host_order: list[bytes] = []  # host snapshots, least recently used first
        #: host rows evicted out of plain LRU order, pending: (key, the first entry while
        #: it was second); cleared when that first entry's promotion is heard
        self.pending: list[tuple[bytes, bytes]] = []
        #: host copies gone without promotion or LRU eviction: must be on the device
        #: (freed as redundant by a ``take`` of their key) once the rule ends
        self.redundant: list[bytes] = []
        self.pool.listeners.append(self)

    # ---- host LRU, watched at every host snapshot stored / removed -------------------
    def on_snapshot_stored(self, block_hash: bytes, where: str) -> None:
        if where == "host":
            assert block_hash not in self.host_order
            self.host_order.append(block_hash)  # demoted: most recently used

    def on_snapshot_removed(self, block_hash: bytes, where: str) -> None:
        """A host row left: promoted (already in a slot), the least recently demoted
        one evicted for room, the second while the first is being promoted (kept out
        of its own eviction: pending until that promotion is heard), or a copy freed as
        redundant by a ``take`` of its key (on the device once the rule ends)."""
        if where != "host":
            return
        order = self.host_order
        i = order.index(block_hash)
        del order[i]
        if self.pool.has_snapshot(block_hash):  # promoted
            self.pending = [(h, f) for h, f in self.pending if f != block_hash]
        elif i == 1:
            self.pending.append((block_hash, order[0]))
        elif i != 0:
            self.redundant.append(block_hash)

    def _judge_host_lru(self) -> None:
        """Between rules: every eviction explained (class docstring)."""
        pool = self.pool
        for h, _ in self.pending:
            assert pool.has_snapshot(h) or pool.has_host_snapshot(h), (
                "host row evicted out of LRU order"
            )
        for h in self.redundant:
            assert pool.has_snapshot(h) or pool.has_host_snapshot(h), (
                "host row evicted out of LRU order"
            )
        self.pending, self.redundant = [], []
        assert self.host_order == pool.host_snapshot_hashes()

    # ---- tensors -----------------------------------------------------------------
    def _id(self, prefix: tuple[int, ...]) -> int:
        if prefix not in self.ids:
            self.ids[prefix] = len(self.prefixes)
            self.prefixes.append(prefix)
        return self.ids[prefix]

    def _write(self, slot: int, prefix: tuple[int, ...]) -> None:
        i = self._id(prefix)
        for layer, c in enumerate(self.dev):
            c.conv[slot].fill_(i + 1 + 1000 * layer)
            c.ssm[slot].fill_(-(i + 1 + 1000 * layer))

    @staticmethod
    def _read(caches: list[StateCache], row: int) -> int | None:
        """The prefix id a slot (row) holds in every layer, None when the layers (or
        conv and ssm) disagree or the content is no id's."""
        got = set()
        for layer, c in enumerate(caches):
            for t, sign in ((c.conv[row], 1), (c.ssm[row], -1)):
                v = t.flatten()
                if not bool((v == v[0]).all()):
                    return None
                got.add(int(sign * v[0].item()) - 1 - 1000 * layer)
        return got.pop() if len(got) == 1 else None

    # ---- scheduler-like rules ----------------------------------------------------
    def _forward(self, rid: str, start: int, end: int) -> None:
        run_slot_copies(self.dev, self.m.take_state_copies(), self.host)
        s = self.m.state_slot(rid)
        toks = self.reqs[rid]
        if start:  # a hit (or the previous chunk): the slot holds exactly that state
            assert self._read(self.dev, s) == self.ids[tuple(toks[:start])], "wrong state"
        self._write(s, tuple(toks[:end]))
        self.m.commit(rid, toks, end)
        self.done[rid] = end
        for i, h in enumerate(hash_request_blocks(toks[:end], BS)):
            self.by_hash[h] = tuple(toks[: (i + 1) * BS])

    def _admit(self, toks: list[int], budget: int, finish: int | None) -> None:
        """Admit ``toks`` (preempting the oldest running requests while it does not
        fit, as a scheduler under memory pressure), prefill its first chunk; with
        ``finish``, run it to the end and ``finish`` decode tokens, then free it."""
        rid = f"r{self.n}"
        self.n += 1
        while True:
            cached = self.m.get_num_cached_tokens(toks)
            end = self.m.state_chunk_end(rid, toks, cached, min(len(toks), cached + budget))
            if self.m.allocate(rid, toks, end - cached, num_cached_tokens=cached) is not None:
                break
            if not self.reqs:
                return
            self._free(min(self.reqs, key=lambda r: int(r[1:])))
        self.reqs[rid] = toks
        self.sent.append(list(toks))
        self._forward(rid, cached, end)
        if finish is not None:
            self._finish(rid, finish)

    # two rules only: Hypothesis' swarm testing switches rules off per example, and a
    # run without arrivals would test nothing
    @rule(
        data=st.data(),
        resend=st.booleans(),
        prefix=st.sampled_from([0, 20, 40, 70]),
        tail=st.integers(1, 40),
        budget=st.integers(1, 128),
        finish=st.none() | st.integers(0, 20),
    )
    def arrive(
        self,
        data: st.DataObject,
        resend: bool,
        prefix: int,
        tail: int,
        budget: int,
        finish: int | None,
    ) -> None:
        """A new prompt (its snapshots push older ones to the host rows), or one of the
        last 6 prompts sent, again: it hits its snapshot, often from a host row (its KV
        is likelier still cached than an older one's)."""
        if resend and self.sent:
            toks = list(data.draw(st.sampled_from(self.sent[-6:])))
        else:
            toks = list(range(prefix)) + [10_000 + 100 * self.n + i for i in range(tail)]
        self._admit(toks, budget, finish)

    @rule(
        data=st.data(),
        action=st.sampled_from(["step", "step", "free", "finish"]),
        budget=st.integers(1, 64),
        decode=st.integers(0, 20),
    )
    def advance(self, data: st.DataObject, action: str, budget: int, decode: int) -> None:
        """A running request: one chunk or decode step (preempted by recompute when it
        does not fit), freed, or run to its end and ``decode`` tokens."""
        if not self.reqs:
            return
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        if action == "free":
            self._free(rid)
            return
        if action == "finish":
            self._finish(rid, decode)
            return
        toks, start = self.reqs[rid], self.done[rid]
        if start == len(toks):  # decode: sample a token first
            toks.append(20_000 + len(toks))
        end = self.m.state_chunk_end(rid, toks, start, min(len(toks), start + budget))
        if self.m.allocate(rid, toks, end - start) is None:
            self._free(rid)
            return
        self._forward(rid, start, end)

    def _free(self, rid: str) -> None:
        self.m.free(rid)
        del self.reqs[rid]
        self.done.pop(rid, None)  # (none when its first forward failed)

    def _finish(self, rid: str, decode: int) -> None:
        """``rid``'s prefill to its end, ``decode`` tokens, then finished (its prompt
        and rolling decode snapshots stay cached); freed early when it does not fit."""
        toks = self.reqs[rid]
        target = len(toks) + decode
        while self.done[rid] < target:
            start = self.done[rid]
            if start == len(toks):
                toks.append(20_000 + len(toks))
            end = self.m.state_chunk_end(rid, toks, start, len(toks))
            if self.m.allocate(rid, toks, end - start) is None:
                break
            self._forward(rid, start, end)
        self._free(rid)

    # ---- invariants --------------------------------------------------------------
    @invariant()
    def slots_and_rows_hold_their_keys(self) -> None:
        pool = self.pool
        self._judge_host_lru()
        self.m.check_integrity()
        pool.check_integrity(sorted(self.reqs))
        assert pool.num_host_used <= pool.num_host_snapshots
        assert pool.num_host_used * self.S <= self.host_budget  # bytes within budget
        # what the slots and rows hold once the queued copies ran (on copies of them)
        dev = [StateCache(c.conv.clone(), c.ssm.clone()) for c in self.dev]
        host = None if self.host is None else [StateCache(c.conv.clone(), c.ssm.clone()) for c in self.host]  # fmt: skip
        run_slot_copies(dev, pool.pending_copies(), host)
        slots = [pool.snapshot_slot(h) for h in pool.snapshot_hashes()]
        assert len(set(slots)) == len(slots)
        for h, slot in zip(pool.snapshot_hashes(), slots):
            assert slot is not None
            assert self._read(dev, slot) == self.ids[self.by_hash[h]], "snapshot slot"
        on_host = [h for h in self.by_hash if pool.has_host_snapshot(h)]
        assert len(on_host) == pool.num_host_used
        if on_host:
            assert host is not None
            held = [self._read(host, r) for r in range(pool.num_host_snapshots)]
            for h in on_host:
                assert self.ids[self.by_hash[h]] in held, "host snapshot lost its state"
            assert not any(pool.has_snapshot(h) for h in on_host)  # one place each

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for rid in sorted(self.reqs):
            self._free(rid)
        self.m.check_integrity()
        assert self.pool.num_live_used == 0 and self.m.num_used_blocks == 0
        self.pool.check_integrity([])
        assert self.m.reset_prefix_cache()
        assert self.pool.num_snapshots == 0 and self.pool.num_host_used == 0
        self.pool.check_integrity([])


# example counts from the repo's Hypothesis profile (conftest.py: ci 15, thorough 300)
HostStateMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestHostStateMachine = HostStateMachine.TestCase


def test_skipped_predicted_snapshot_keeps_the_host_copy() -> None:
    p = StatePool(1, 1, SnapshotPolicy(BS, predicted_share=0.0), num_host_snapshots=1)
    p.allocate_live("r")
    p.take("r", b"A", "prompt")
    p.take("r", b"B", "prompt")  # A to the host row
    assert p.has_host_snapshot(b"A")
    assert p.take("r", b"A", "predicted") is None  # skipped: cap 0
    assert p.has_host_snapshot(b"A") or p.has_snapshot(b"A")


def test_rolling_decode_snapshot_keeps_the_host_copy() -> None:
    """A rolling decode snapshot over a key a host row holds is skipped: a device copy
    would be dropped at the request's next decode snapshot, never demoted, and the
    freed host copy lost with it."""
    p = StatePool(1, 2, SnapshotPolicy(BS), num_host_snapshots=3)
    p.allocate_live("r")
    for h in (b"A", b"B", b"C"):
        p.take("r", h, "prompt")  # A to the host row
    assert p.has_host_snapshot(b"A") and not p.has_snapshot(b"A")
    skipped = p.stats.snapshots_skipped
    assert p.take("r", b"A", "decode") is None
    assert p.stats.snapshots_skipped == skipped + 1
    p.take("r", b"D", "decode")
    p.take("r", b"E", "decode")  # replaces the rolling D (dropped)
    assert not p.has_snapshot(b"A") and p.has_host_snapshot(b"A")
    p.check_integrity(["r"])
