"""Shared helpers of the cache tests: spec construction and full-state snapshots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvpage.cache import KVCacheManager
from kvpage.specs import CacheSpec, make_cache_spec


def make_spec(
    num_blocks: int,
    block_size: int,
    windows: Sequence[int | None] = (None,),
    kv_pool: str = "per_group",
) -> CacheSpec:
    """A small CacheSpec with one layer per entry of ``windows`` (None = full attention);
    ``kv_pool`` per group by default (the sizes of the tests written for it)."""
    layers = [dict(num_q_heads=4, num_kv_heads=2, head_dim=8, sliding_window=w) for w in windows]
    return make_cache_spec(
        num_layers=len(layers),
        block_size=block_size,
        num_blocks=num_blocks,
        layers=layers,
        kv_pool=kv_pool,
    )


def snapshot(mgr: KVCacheManager, *, ignore_failures: bool = True) -> dict[str, Any]:
    """Everything observable in the manager, as plain data (for 'nothing changed' checks)."""
    pools = []
    for p in mgr.pools:
        pools.append(
            dict(
                blocks=[(b.ref_cnt, b.block_hash) for b in p.blocks],
                free=p.free_queue.ids(),
                cached={h: b.block_id for h, b in p.cached.items()},
                evictions=p.num_evictions,
            )
        )
    reqs = {
        rid: (
            [list(t) for t in r.tables],
            r.num_tokens,
            list(r.hashes),
            r.num_committed,
            list(r.freed),
        )
        for rid, r in mgr._reqs.items()
    }
    stats = asdict(mgr.stats)
    if ignore_failures:
        stats.pop("allocation_failures")
    return dict(pools=pools, reqs=reqs, stats=stats, usage=mgr.usage, free=mgr.num_free_blocks)
