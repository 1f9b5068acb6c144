"""The allocator's layers: KVCacheManager -> group managers -> BlockPool, each using
only the public methods of the layer below, and the KVAllocator contract shared by the
paged manager and the simulator's contiguous allocator."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from cache_helpers import make_spec

import kvpage.cache as C
from kvpage.cache import (
    FullAttentionManager,
    KVAllocator,
    KVCacheManager,
    SlidingWindowManager,
)
from kvpage.sim.contiguous import ContiguousAllocator

CACHE = Path(C.__file__).parent
#: BlockPool/KVBlock internals the upper layers must not touch
POOL_INTERNALS = {"ref_cnt", "block_hash", "free_queue", "cached", "blocks", "prev_free"}


def _foreign_attributes(path: Path) -> list[str]:
    """``x.attr`` uses in ``path`` where ``attr`` is private (``_name``, on anything but
    ``self``/``cls``) or a pool internal."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if (private and owner not in ("self", "cls")) or node.attr in POOL_INTERNALS:
            bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return bad


@pytest.mark.parametrize(
    "module", ["manager.py", "prefix_cache.py", "group_managers.py", "prefix.py", "integrity.py"]
)
def test_upper_layers_use_public_pool_methods_only(module: str) -> None:
    assert _foreign_attributes(CACHE / module) == []


def test_the_check_catches_a_private_access(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f(pool, mgr):\n    pool._release([])\n    return mgr._reqs, pool.blocks\n")
    assert len(_foreign_attributes(f)) == 3


def test_group_manager_types_follow_the_windows() -> None:
    mgr = KVCacheManager(make_spec(8, 2, (None, 4)))
    kinds = [type(gm) for gm in mgr._groups]
    assert kinds == [FullAttentionManager, SlidingWindowManager]
    full, sliding = mgr._groups
    # full attention needs every block; window 4, block 2: position 9 sees keys 6..9
    assert full.first_needed_block(9) == 0 and sliding.first_needed_block(9) == 3


def test_both_allocators_implement_the_protocol() -> None:
    paged = KVCacheManager(make_spec(8, 2))
    contiguous = ContiguousAllocator(64, "max", 16)
    for kv in (paged, contiguous):
        assert isinstance(kv, KVAllocator)
        assert kv.num_used_blocks == 0 and kv.num_groups == 1
        a = kv.allocate("r", [1, 2, 3], 3)
        assert a is not None and kv.num_allocated_tokens("r") == 3
        assert kv.num_used_blocks == (2 if kv is paged else 16)
        kv.free("r")
        assert kv.num_used_blocks == 0
        kv.check_integrity()


def test_free_puts_a_sequences_last_blocks_first_in_eviction_order() -> None:
    mgr = KVCacheManager(make_spec(8, 2))
    toks = list(range(1, 8))  # 3 full blocks + 1 partial
    assert mgr.allocate("a", toks, 7) is not None
    mgr.commit("a", toks, 7)
    table = mgr.block_table("a")
    mgr.free("a")
    order = mgr.pools[0].free_queue.ids()  # head (evicted first) -> tail
    assert order[0] == table[3]  # the uncached partial block is reused first
    assert [b for b in order if b in table[:3]] == table[2::-1]  # then last block first


def test_append_fast_path_agrees_with_the_general_path() -> None:
    """``allocate``'s ``try_append`` fast path (one full-attention group) gives the same
    tables, allocations and stats as the general plan/grow path, forks and CoW included."""
    fast = KVCacheManager(make_spec(24, 4))
    general = KVCacheManager(make_spec(24, 4))
    general._simple = False
    results: list[list[object]] = [[], []]
    for k, mgr in enumerate((fast, general)):
        toks = {"a": list(range(1, 7)), "b": list(range(1, 7))}
        for rid, t in toks.items():
            hit = mgr.get_num_cached_tokens(t)
            results[k].append(mgr.allocate(rid, t, len(t) - hit, num_cached_tokens=hit))
            mgr.commit(rid, t, len(t))
        mgr.fork("a", "a1")  # shares a partial block: the next append copies it
        toks["a1"] = list(toks["a"])
        for step in range(9):
            for rid, t in toks.items():
                t.append(100 + step)
                results[k].append(mgr.allocate(rid, t, 1))
                mgr.commit(rid, t, len(t))
        results[k].append([mgr.block_tables(r) for r in toks])
        results[k].append(mgr.stats)
        mgr.check_integrity()
    assert results[0] == results[1]
