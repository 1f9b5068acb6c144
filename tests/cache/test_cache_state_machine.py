"""A Hypothesis state machine drives KVCacheManager like a scheduler under memory
pressure (add with prefix hits, chunked prefill, decode, fork, free, eviction, hybrid
groups) and checks after every rule:

* free + used == total blocks, per group, and usage in [0, 1];
* every ref count == the number of block tables holding the block (the test keeps its
  own copy of every table, built from the Allocation results);
* no block is handed out twice (a new block was held by nobody);
* a write never lands in a shared block (CoW happened first);
* every hash entry points to a block whose written content (tracked here, token by
  token) is exactly the content the hash names; every block of a running request holds
  that request's tokens, and every key its next query can see (all earlier positions,
  or the last ``W`` in a sliding-window group) is still in its block table;
* a failed allocation (None) changes nothing but the failure counter.

Retention rules (kept apart: ``retention_*`` rules and ``retention_invariants``) give
live requests priority/TTL policies, advance a fake clock and admit requests checking
that new blocks come from the head of the eviction order (lowest priority level first,
LRU within it, expired retention already demoted); after every step: each free block's
level matches its priority, raised levels hold only cached blocks, at most
``max_retained_blocks`` are retained, and no live deadline is in the past after expiry.
``TierCacheMachine`` runs the same rules with a host and a disk KV tier below the pool
(``kvpage.cache.tiered``) plus tier rules (restart under the same or another
fingerprint, a damaged disk file, a full disk) and checks the tier invariants after
every step (see its docstring).
"""

from __future__ import annotations

import ast
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from cache_helpers import make_spec, snapshot
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpage.cache import (
    PRIORITY_DEFAULT,
    KVCacheManager,
    KVRetention,
    RetentionRange,
    hash_request_blocks,
)
from kvpage.cache.tier_store import DiskTier, HostTier, payload_nbytes
from kvpage.cache.tiered import TieredCache

LAYOUTS: list[tuple[int | None, ...]] = [
    (None,),
    (None,),
    (3,),
    (None, 4),
    (2, None, 6),
    (None, 3, 3, None, 3, 3),  # unified: 3 groups of 2 layers (1 full, 2 sliding)
]
VOCAB = st.integers(0, 2)  # tiny vocabulary: prompts share prefixes often
BASES = [[1, 2, 0, 1, 1, 2, 2, 0, 1, 0, 2, 1, 0, 0], [2, 2, 1, 0, 0, 1, 2, 1, 1, 2, 0, 0, 1, 2]]
# prompts: a prefix of a base prompt plus a short random tail (shared prefixes -> hits)
PROMPTS = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, 1),
    st.integers(0, 14),
    st.lists(VOCAB, max_size=3),
).filter(lambda p: len(p) > 0)


class Req:
    def __init__(self, tokens: list[int], salt: str | None, prompt_len: int) -> None:
        self.tokens = tokens
        self.salt = salt
        self.prompt_len = prompt_len
        self.allocated = 0
        self.computed = 0
        self.tables: list[list[int]] = []


class CacheMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 12),
        layout=st.sampled_from(LAYOUTS),
        caching=st.sampled_from([True, True, False]),
        kv_pool=st.sampled_from(["per_group", "unified"]),
    )
    def setup(
        self, block_size: int, num_blocks: int, layout: Any, caching: bool, kv_pool: str
    ) -> None:
        self.bs = block_size
        if kv_pool == "unified":  # the same bytes: a unified block holds one group's layers
            num_blocks = (num_blocks - 1) * len(make_spec(2, 1, layout, kv_pool).kv_groups) + 1
        self.mgr = KVCacheManager(
            make_spec(num_blocks, block_size, layout, kv_pool),
            enable_prefix_caching=caching,
            hash_seed=1,
        )
        self.unified = self.mgr.unified
        self.model: dict[str, Req] = {}
        # content[g][block_id][offset] = (salt, tuple of tokens 0..p) of the K/V written there
        self.content: list[list[list[Any]]] = [
            [[None] * block_size for _ in range(num_blocks)] for _ in range(self.mgr.num_groups)
        ]
        self.next_id = 0

    # ---- helpers ------------------------------------------------------------------------
    def _holders(self) -> list[list[int]]:
        h = [[0] * self.mgr.pools[g].num_blocks for g in range(self.mgr.num_groups)]
        for r in self.model.values():
            for g, t in enumerate(r.tables):
                for b in t:
                    if b:
                        h[g][b] += 1
        return h

    def _held(self, holders: list[list[int]], g: int, b: int) -> int:
        """Tables holding block ``b`` of group ``g`` (a unified pool: of any group)."""
        if self.unified:
            return sum(h[b] for h in holders)
        return holders[g][b]

    def _apply(self, rid: str, alloc: Any) -> None:
        r = self.model[rid]
        for g in range(self.mgr.num_groups):
            actual = self.mgr.block_table(rid, g)
            # window freeing replaced a prefix with the null block (released first, so
            # this very allocation may reuse those blocks)
            r.tables[g] = [0 if a == 0 else b for a, b in zip(actual, r.tables[g])]
        holders = self._holders()
        for g in range(self.mgr.num_groups):
            for b in alloc.new_blocks[g] + [d for _, d in alloc.copies[g]]:
                assert b != 0 and self._held(holders, g, b) == 0, f"block {b} handed out twice"
                self.content[g][b] = [None] * self.bs
            for src, dst in alloc.copies[g]:  # the backend copies before writing
                assert holders[g][src] >= 2, "copy of a block that was not shared"
                self.content[g][dst] = list(self.content[g][src])
                i = r.tables[g].index(src)
                r.tables[g][i] = dst
            r.tables[g] += alloc.new_blocks[g]
            assert r.tables[g] == self.mgr.block_table(rid, g)
        copies = self.mgr.block_tables(rid)  # the scheduler's one-call form: equal copies
        assert copies == r.tables
        copies[0].append(-5)
        assert self.mgr.block_table(rid, 0) == r.tables[0]

    def _run_step(self, rid: str) -> None:
        """The step runs: write K/V of positions [computed, allocated), each query then
        reading the keys it can see (all earlier ones, or the last W in a sliding
        group), which must be held and hold this request's tokens; then commit."""
        r = self.model[rid]
        for p in range(r.computed, r.allocated):
            for g in range(self.mgr.num_groups):
                b = r.tables[g][p // self.bs]
                assert b != 0
                assert self.mgr.pools[g].blocks[b].ref_cnt == 1, "write into a shared block"
                self.content[g][b][p % self.bs] = (r.salt, tuple(r.tokens[: p + 1]))
                w = self.mgr.windows[g]
                for q in range(0 if w is None else max(0, p - w + 1), p):
                    kb = r.tables[g][q // self.bs]
                    assert kb != 0, f"query {p} reads key {q}: released (group {g})"
                    assert self.content[g][kb][q % self.bs] == (r.salt, tuple(r.tokens[: q + 1]))
        r.computed = r.allocated
        self.mgr.commit(rid, r.tokens, r.computed)

    def _try(self, rid: str, fn: Any) -> Any:
        before = snapshot(self.mgr)
        fails = self.mgr.stats.allocation_failures
        alloc = fn()
        if alloc is None:
            assert snapshot(self.mgr) == before
            assert self.mgr.stats.allocation_failures == fails + 1
        return alloc

    # ---- rules ---------------------------------------------------------------------------
    @rule(
        target=reqs,
        prompt=PROMPTS,
        salt=st.sampled_from([None, None, "s"]),
        chunk=st.integers(1, 16),
        run=st.booleans(),
    )
    def add(self, prompt: list[int], salt: str | None, chunk: int, run: bool) -> Any:
        rid = f"r{self.next_id}"
        self.next_id += 1
        before = snapshot(self.mgr, ignore_failures=False)
        hit = self.mgr.get_num_cached_tokens(prompt, cache_salt=salt)
        if self.mgr.tiers is None:  # a peek changes nothing (with tiers it may promote)
            assert snapshot(self.mgr, ignore_failures=False) == before
        assert hit % self.bs == 0 and 0 <= hit <= max(0, len(prompt) - 1)
        n = min(chunk, len(prompt) - hit)
        alloc = self._try(
            rid,
            lambda: self.mgr.allocate(rid, prompt, n, num_cached_tokens=hit, cache_salt=salt),
        )
        if alloc is None:
            return None
        assert alloc.num_cached_tokens == hit
        r = Req(list(prompt), salt, len(prompt))
        r.tables = [[] for _ in range(self.mgr.num_groups)]
        self.model[rid] = r
        r.tables = [self.mgr.block_table(rid, g)[: hit // self.bs] for g in range(len(r.tables))]
        # the hit blocks must already hold exactly this request's K/V
        for g, t in enumerate(r.tables):
            for i, b in enumerate(t):
                if b:
                    for o in range(self.bs):
                        p = i * self.bs + o
                        assert self.content[g][b][o] == (salt, tuple(prompt[: p + 1]))
        r.allocated = r.computed = hit
        self._apply(rid, alloc)
        r.allocated = hit + n
        if run:
            self._run_step(rid)
        return rid

    @rule(rid=reqs, chunk=st.integers(1, 8), token=VOCAB)
    def schedule(self, rid: str | None, chunk: int, token: int) -> None:
        """Next step for a request: run its pending step, or allocate its next tokens
        (the next prefill chunk, or one decoded token) and run them."""
        r = self.model.get(rid) if rid else None
        if r is None:
            return
        if r.computed < r.allocated:
            self._run_step(rid)  # type: ignore[arg-type]
            return
        if r.allocated < r.prompt_len:
            n = min(chunk, r.prompt_len - r.allocated)
        else:
            r.tokens.append(token)  # the sampled token; its K/V is computed now
            n = 1
        alloc = self._try(rid, lambda: self.mgr.allocate(rid, r.tokens, n))  # type: ignore[arg-type]
        if alloc is None:
            if r.allocated >= r.prompt_len:
                r.tokens.pop()
            return
        assert alloc.num_cached_tokens == 0
        self._apply(rid, alloc)  # type: ignore[arg-type]
        r.allocated += n
        self._run_step(rid)  # type: ignore[arg-type]

    @precondition(lambda self: len(self.model) > 0)
    @rule(target=reqs, data=st.data())
    def fork(self, data: st.DataObject) -> Any:
        ready = sorted(k for k, r in self.model.items() if r.computed == r.allocated)
        if not ready:
            return None
        parent = data.draw(st.sampled_from(ready))
        child = f"r{self.next_id}"
        self.next_id += 1
        self.mgr.fork(parent, child)
        p = self.model[parent]
        c = Req(list(p.tokens), p.salt, p.prompt_len)
        c.allocated, c.computed = p.allocated, p.computed
        c.tables = [list(t) for t in p.tables]
        self.model[child] = c
        return child

    @rule(rid=consumes(reqs))
    def free(self, rid: str | None) -> None:
        if rid is None or rid not in self.model:
            return
        self.mgr.free(rid)
        del self.model[rid]
        assert not self.mgr.has_request(rid)

    @rule()
    def reset_prefix_cache(self) -> None:
        busy = any(p.num_used for p in self.mgr.pools)
        assert self.mgr.reset_prefix_cache() is (not busy)
        if not busy:
            assert all(not p.cached for p in self.mgr.pools)
            assert all(b.block_hash is None for p in self.mgr.pools for b in p.blocks)

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def invariants(self) -> None:
        mgr = self.mgr
        mgr.check_integrity()
        assert 0.0 <= mgr.usage <= 1.0
        holders = self._holders()
        for g, pool in enumerate(mgr.pools):
            used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
            assert pool.num_free + used == pool.num_blocks - 1
            for b in pool.blocks[1:]:
                assert b.ref_cnt == self._held(holders, g, b.block_id)
            # no hash entry names content other than what the block holds
            for h, b in pool.cached.items():
                cells = self.content[g][b.block_id]
                assert None not in cells, "hash entry on a block not fully written"
                salt, toks = cells[-1]
                assert all(
                    c == (salt, toks[: len(toks) - self.bs + 1 + o]) for o, c in enumerate(cells)
                )
                assert (
                    hash_request_blocks(list(toks), self.bs, cache_salt=salt, hash_seed=1)[-1] == h
                )
        for rid, r in self.model.items():
            assert mgr.num_allocated_tokens(rid) == r.allocated
            for g, t in enumerate(r.tables):
                w = mgr.windows[g]
                # keys the next query (position r.computed) can see are still held
                seen_from = 0 if w is None else max(0, r.computed - w + 1)
                for p in range(r.computed):
                    b = t[p // self.bs]
                    assert b or p < seen_from, f"key {p} released but visible (group {g})"
                    if b:
                        assert self.content[g][b][p % self.bs] == (r.salt, tuple(r.tokens[: p + 1]))
        if not self.model:
            assert mgr.usage == 0.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class RetentionRules(CacheMachine):
    """The cache machine plus retention rules and checks (see the module docstring)."""

    clock: FakeClock | None = None

    def _retention_clock(self, cap: int) -> FakeClock:
        """Install a fake clock (and a drawn retention cap) in every pool on first use;
        no policy exists before, so no deadline used the real clock."""
        if self.clock is None:
            self.clock = FakeClock()
            for p in self.mgr.block_pools:
                assert p.num_retained == 0
                p.clock = self.clock
                p.max_retained_blocks = min(cap, p.num_usable)
        return self.clock

    @rule(
        data=st.data(),
        prio=st.integers(0, 3),
        ttl=st.sampled_from([None, 1.0, 5.0]),
        decode=st.integers(0, 3),
        cap=st.integers(0, 6),
    )
    def retention_set(
        self, data: st.DataObject, prio: int, ttl: float | None, decode: int, cap: int
    ) -> None:
        if not self.model:
            return
        self._retention_clock(cap)
        rid = data.draw(st.sampled_from(sorted(self.model)))
        r = self.model[rid]
        end = data.draw(st.integers(1, max(1, r.prompt_len)))
        policy = KVRetention((RetentionRange(0, end, prio, ttl),), decode, ttl)
        self.mgr.set_retention(rid, policy, r.prompt_len)

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]), cap=st.integers(0, 6))
    def retention_advance_clock(self, dt: float, cap: int) -> None:
        clock = self._retention_clock(cap)
        clock.t += dt
        for p in self.mgr.block_pools:
            p.expire()

    @rule(prompt=PROMPTS, salt=st.sampled_from([None, "s"]))
    def retention_admit_checks_eviction_order(self, prompt: list[int], salt: str | None) -> None:
        """Admit and release a request at once: its new blocks must be the head of each
        pool's eviction order (hit blocks excluded)."""
        mgr = self.mgr
        hit = mgr.get_num_cached_tokens(prompt, cache_salt=salt)
        for p in mgr.block_pools:
            p.expire()  # what allocate does first (same clock reading)
        orders = [p.free_queue.ids() for p in mgr.pools]
        rid = f"r{self.next_id}"
        self.next_id += 1
        alloc = mgr.allocate(rid, prompt, len(prompt) - hit, num_cached_tokens=hit, cache_salt=salt)
        if alloc is None:
            return
        nh = hit // self.bs
        taken: set[int] = set()  # a unified pool: earlier groups took the head first
        for g in range(mgr.num_groups):
            held = set(mgr.block_table(rid, g)[:nh])
            if self.unified:
                held = {b for x in range(mgr.num_groups) for b in mgr.block_table(rid, x)[:nh]}
            expect = [b for b in orders[g] if b not in held and b not in taken]
            expect = expect[: len(alloc.new_blocks[g])]
            assert alloc.new_blocks[g] == expect, f"group {g}: not the head of the eviction order"
            taken.update(expect if self.unified else ())
            for b in alloc.new_blocks[g]:
                self.content[g][b] = [None] * self.bs  # reused: its old K/V is gone
        mgr.free(rid)

    @invariant()
    def retention_invariants(self) -> None:
        for p in self.mgr.block_pools:
            assert p.num_retained <= p.max_retained_blocks
            for level, q in enumerate(p.free_queue.levels):
                for b in q:
                    if b.block_hash is None:
                        assert level == 0 and b.priority == PRIORITY_DEFAULT
                    else:
                        assert b.priority == level, f"{b!r} in level {level}"
            if self.clock is not None:
                for deadline, stamp, b in p._expiry:
                    if b.stamp == stamp and b.level > PRIORITY_DEFAULT:
                        assert deadline > self.clock.t, "an expired block is still retained"


# ---- KV tiers --------------------------------------------------------------------------
FINGERPRINTS = {"A": b"A" * 16, "B": b"B" * 16}


# shorter prompts over the same two bases: several fit the small pools at once
TIER_PROMPTS = st.builds(
    lambda base, cut, tail: BASES[base][:cut] + tail,
    st.integers(0, 1),
    st.integers(2, 10),
    st.lists(VOCAB, max_size=2),
)


class ContentMover:
    """The BlockMover of the tier machine: a block's 'K/V' is the machine's content model
    of it (``content[0][block_id]``), serialised with the fingerprint's tag; a payload
    written by a mover of another fingerprint decodes to foreign cells, which the
    content invariants then catch."""

    def __init__(self, machine: Any, tag: str) -> None:
        self.m = machine
        self.tag = tag
        self.block_nbytes = 0  # variable-size payloads: exact byte accounting is checked

    def read_blocks(self, block_ids: Any) -> list[bytes]:
        self.m.read_calls += 1
        out = []
        for b in block_ids:  # the device still holds an evicted block's old K/V
            cells = self.m.device_old.pop(b, None) or self.m.content[0][b]
            out.append(repr((self.tag, cells)).encode())
        return out

    def write_blocks(self, block_ids: Any, payloads: Any) -> None:
        for b in block_ids:
            assert b not in self.m.device_old, "write into a pending block before flush"
        for b, p in zip(block_ids, payloads):
            tag, cells = ast.literal_eval(bytes(p).decode())
            if tag != self.tag:
                cells = [("FOREIGN", ()) for _ in cells]
            self.m.content[0][b] = list(cells)


def decode(payload: Any) -> tuple[str, list[Any]]:
    tag, cells = ast.literal_eval(bytes(payload).decode())
    return tag, list(cells)


class TierCacheMachine(CacheMachine):
    """The cache machine with a host tier and a disk tier below the pool (one
    full-attention group), plus tier rules: restart (pool and host lost, disk kept,
    possibly under another fingerprint), corrupt / truncate / delete a disk file, disk
    full. Checked after every step: each hash at most once per tier (index == files on
    disk), host and pool exclusive, every payload in every tier holds exactly the content
    its hash names (so promotion can only bring back the right K/V), nothing of one
    fingerprint is served under another, per-tier byte accounting exact and within
    capacity."""

    @initialize(
        block_size=st.sampled_from([1, 2, 2, 4]),
        num_blocks=st.integers(4, 8),
        host_blocks=st.integers(0, 4),
        disk_blocks=st.integers(0, 6),
    )
    def setup(  # type: ignore[override]
        self, block_size: int, num_blocks: int, host_blocks: int, disk_blocks: int
    ) -> None:
        super().setup(block_size, num_blocks, (None,), True, "per_group")
        self.num_blocks = num_blocks
        self.root = Path(tempfile.mkdtemp(prefix="kvtiers-"))
        # payload sizes vary (repr); ~60 bytes per token cell is a generous unit
        unit = 60 * block_size + 40
        self.host_cap = host_blocks * unit
        self.disk_cap = max(1, disk_blocks) * unit if disk_blocks or not host_blocks else 0
        self.fp = "A"
        self.broken: set[bytes] = set()
        # block id -> the old K/V the device still holds for a pending (evicted, not
        # yet flushed) block that the model already reset for its new owner
        self.device_old: dict[int, list[Any]] = {}
        self.read_calls = 0
        self._attach()

    def _attach(self) -> None:
        host = HostTier(self.host_cap) if self.host_cap else None
        disk = DiskTier(self.root, self.disk_cap, FINGERPRINTS[self.fp]) if self.disk_cap else None
        self.tiers = TieredCache(
            self.mgr.pools[0], ContentMover(self, self.fp), host=host, disk=disk
        )
        self.mgr.attach_tiers(self.tiers)

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _apply(self, rid: str, alloc: Any) -> None:
        """Scheduling reset the model's content of the new blocks; the device keeps a
        pending block's old K/V until the step's forward writes (after the flush)."""
        old = {b: list(self.content[0][b]) for b, _ in self.tiers.pending}
        super()._apply(rid, alloc)
        for b, cells in old.items():
            if self.content[0][b] != cells:
                self.device_old.setdefault(b, cells)

    def _run_step(self, rid: str) -> None:
        """The engine's order: flush (the step's one batched copy-out), then the forward."""
        self.tiers.flush()
        assert not self.device_old, "the forward would overwrite a pending block"
        super()._run_step(rid)

    # ---- tier rules ------------------------------------------------------------------
    @rule()
    def flush(self) -> None:
        """The step boundary: all pending demotions in one ``read_blocks`` call."""
        n = len(self.tiers.pending)
        calls = self.read_calls
        assert self.tiers.flush() == n
        assert self.read_calls == calls + (1 if n else 0)
        assert not self.tiers.pending and not self.device_old

    @rule(prompt=TIER_PROMPTS, salt=st.sampled_from([None, None, "s"]))
    def lookup(self, prompt: list[int], salt: str | None) -> None:
        """A prefix lookup between scheduling and the step (promotes; sees pending)."""
        self.mgr.get_num_cached_tokens(prompt, cache_salt=salt)

    @rule(go=st.integers(0, 15))
    def reset_prefix_cache(self, go: int) -> None:  # type: ignore[override]
        """Rare here (it clears every tier): 1 draw in 16."""
        if go == 0:
            super().reset_prefix_cache()
            pend = {b for b, _ in self.tiers.pending}  # a reset forgets pending blocks
            self.device_old = {b: c for b, c in self.device_old.items() if b in pend}
            if not any(p.num_used for p in self.mgr.pools):
                assert all(len(t) == 0 for t in self.tiers.tiers)

    @rule(prompt=TIER_PROMPTS, salt=st.sampled_from([None, None, "s"]))
    def cycle(self, prompt: list[int], salt: str | None) -> None:
        """A whole request at once: lookup (promotes), prefill, free -- the churn that
        evicts (demotes) and brings blocks back."""
        rid = self.add(prompt, salt, 64, True)
        if rid is not None:
            r = self.model[rid]
            assert r.computed == len(prompt)
            self.free(rid)

    @precondition(lambda self: not self.model)
    @rule(fp=st.sampled_from(["A", "A", "B"]))
    def restart(self, fp: str) -> None:
        """A new process: fresh pool and host tier, the disk directory kept."""
        self.mgr = KVCacheManager(
            make_spec(self.num_blocks, self.bs), enable_prefix_caching=True, hash_seed=1
        )
        self.content = [[[None] * self.bs for _ in range(self.num_blocks)]]
        self.fp = fp
        self.broken = set()
        self.device_old = {}
        self._attach()
        if self.tiers.disk is not None:
            on_disk = {p.name for p in self.tiers.disk.dir.iterdir()}
            assert on_disk == {h.hex() + ".kvb" for h in self.tiers.disk.hashes()}

    @precondition(lambda self: self.disk_cap > 0)
    @rule(data=st.data(), how=st.sampled_from(["truncate", "flip", "delete", "swap"]))
    def damage_file(self, data: st.DataObject, how: str) -> None:
        disk = self.tiers.disk
        assert disk is not None
        hs = sorted(h for h in disk.hashes() if h not in self.broken)
        if not hs:
            return
        h = data.draw(st.sampled_from(hs))
        f = disk.dir / (h.hex() + ".kvb")
        raw = f.read_bytes()
        if how == "truncate":
            f.write_bytes(raw[: len(raw) // 2])
        elif how == "flip":
            i = data.draw(st.integers(0, len(raw) - 1))
            f.write_bytes(raw[:i] + bytes([raw[i] ^ 0x41]) + raw[i + 1 :])
        elif how == "delete":
            f.unlink()
        else:  # another block's (valid) file under this name: the hash check refuses it
            others = [o for o in hs if o != h]
            if not others:
                return
            f.write_bytes((disk.dir / (others[0].hex() + ".kvb")).read_bytes())
        self.broken.add(h)
        before = disk.stats.corrupt
        assert disk.get(h) is None  # refused, counted, removed
        assert disk.stats.corrupt == before + 1 and h not in disk
        self.broken.discard(h)

    @precondition(lambda self: self.disk_cap > 0)
    @rule()
    def disk_full(self) -> None:
        """Every later write fails with ENOSPC: demotion to disk stops, serving goes on."""
        disk = self.tiers.disk
        assert disk is not None

        def fail(*a: Any, **k: Any) -> None:
            raise OSError(28, "No space left on device")

        disk._write_file = fail  # type: ignore[method-assign]

    # ---- tier invariants -------------------------------------------------------------
    def _check_cells(self, h: bytes, cells: list[Any]) -> None:
        assert None not in cells, "a tier holds a block that was not fully written"
        salt, toks = cells[-1]
        assert all(c == (salt, toks[: len(toks) - self.bs + 1 + o]) for o, c in enumerate(cells))
        assert hash_request_blocks(list(toks), self.bs, cache_salt=salt, hash_seed=1)[-1] == h

    @invariant()
    def tier_invariants(self) -> None:
        tiers = self.tiers
        pool = self.mgr.pools[0]
        host, disk = tiers.host, tiers.disk
        # pending blocks are in no tier yet (disk may keep an older copy of the hash)
        # and the device still holds their K/V; stale device content only for them
        pend = tiers.pending
        assert set(self.device_old) <= {b for b, _ in pend}
        assert len({b for b, _ in pend}) == len(pend), "a block id pending twice"
        for b, h in pend:
            assert h not in pool.cached and (host is None or h not in host)
            cells = self.device_old.get(b, self.content[0][b])
            self._check_cells(h, list(cells))
        if host is not None:
            assert set(host._data) == set(host._sizes)
            assert host.used_bytes == sum(payload_nbytes(p) for p in host._data.values())
            assert host.used_bytes <= host.capacity_bytes
            for h, p in host._data.items():
                assert h not in pool.cached, "a block both in the pool and the host tier"
                tag, cells = decode(p)
                assert tag == self.fp, "host tier holds another fingerprint's block"
                self._check_cells(h, cells)
        if disk is not None:
            files = {p.name for p in disk.dir.iterdir()}
            assert files == {h.hex() + ".kvb" for h in disk.hashes()}, "index != files"
            assert disk.used_bytes == sum(disk._sizes.values())
            assert disk.used_bytes <= disk.capacity_bytes
            for h in list(disk.hashes()):
                body = disk._read_verified(h, disk._sizes[h])
                assert body is not None
                assert len(body) == disk._sizes[h]
                tag, cells = decode(body)
                assert tag == self.fp, "disk tier serves another fingerprint's block"
                self._check_cells(h, cells)


class TestTierCacheMachine(TierCacheMachine.TestCase):  # type: ignore[name-defined,misc]
    """More examples than the ci profile's 15: derandomized short runs rarely evict
    enough to promote (measured: 0 promotions at 15 examples, dozens at 100)."""

    settings = settings(
        settings.get_profile("ci"), max_examples=100, stateful_step_count=40, deadline=None
    )


# example counts come from the Hypothesis profile in conftest.py (ci / thorough)
TestCacheMachine = CacheMachine.TestCase
TestCacheRetentionMachine = RetentionRules.TestCase


@pytest.mark.slow
class TestCacheMachineLong(CacheMachine.TestCase):  # type: ignore[name-defined,misc]
    """Longer runs (``-m slow``): more examples and more steps per example."""

    settings = settings(max_examples=400, stateful_step_count=80, deadline=None)


@pytest.mark.slow
class TestCacheRetentionMachineLong(RetentionRules.TestCase):  # type: ignore[name-defined,misc]
    """Longer runs of the retention rules (``-m slow``)."""

    settings = settings(max_examples=400, stateful_step_count=80, deadline=None)
