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
"""

from __future__ import annotations

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

LAYOUTS: list[tuple[int | None, ...]] = [(None,), (None,), (3,), (None, 4), (2, None, 6)]
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
    )
    def setup(self, block_size: int, num_blocks: int, layout: Any, caching: bool) -> None:
        self.bs = block_size
        self.mgr = KVCacheManager(
            make_spec(num_blocks, block_size, layout), enable_prefix_caching=caching, hash_seed=1
        )
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
                assert b != 0 and holders[g][b] == 0, f"block {b} handed out twice"
                self.content[g][b] = [None] * self.bs
            for src, dst in alloc.copies[g]:  # the backend copies before writing
                assert holders[g][src] >= 2, "copy of a block that was not shared"
                self.content[g][dst] = list(self.content[g][src])
                i = r.tables[g].index(src)
                r.tables[g][i] = dst
            r.tables[g] += alloc.new_blocks[g]
            assert r.tables[g] == self.mgr.block_table(rid, g)

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
        assert snapshot(self.mgr, ignore_failures=False) == before  # a peek changes nothing
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
                assert b.ref_cnt == holders[g][b.block_id]
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
            for p in self.mgr.pools:
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
        for p in self.mgr.pools:
            p.expire()

    @rule(prompt=PROMPTS, salt=st.sampled_from([None, "s"]))
    def retention_admit_checks_eviction_order(self, prompt: list[int], salt: str | None) -> None:
        """Admit and release a request at once: its new blocks must be the head of each
        pool's eviction order (hit blocks excluded)."""
        mgr = self.mgr
        hit = mgr.get_num_cached_tokens(prompt, cache_salt=salt)
        for p in mgr.pools:
            p.expire()  # what allocate does first (same clock reading)
        orders = [p.free_queue.ids() for p in mgr.pools]
        rid = f"r{self.next_id}"
        self.next_id += 1
        alloc = mgr.allocate(rid, prompt, len(prompt) - hit, num_cached_tokens=hit, cache_salt=salt)
        if alloc is None:
            return
        for g in range(mgr.num_groups):
            held = set(mgr.block_table(rid, g)[: hit // self.bs])
            expect = [b for b in orders[g] if b not in held][: len(alloc.new_blocks[g])]
            assert alloc.new_blocks[g] == expect, f"group {g}: not the head of the eviction order"
            for b in alloc.new_blocks[g]:
                self.content[g][b] = [None] * self.bs  # reused: its old K/V is gone
        mgr.free(rid)

    @invariant()
    def retention_invariants(self) -> None:
        for p in self.mgr.pools:
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
