"""Whole-manager invariant checks (used by ``KVCacheManager.check_integrity`` and tests).

Checked, per KV group: the pool's own invariants (``BlockPool.check_integrity``); every
block's ``ref_cnt`` equals the number of request block tables holding it; each table has
``ceil(num_tokens / block_size)`` entries, null (0) exactly on the sliding-window-freed
prefix; each request's committed-hash count is consistent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpage.errors import IntegrityError

if TYPE_CHECKING:
    from kvpage.cache.manager import KVCacheManager


def check_manager_integrity(mgr: KVCacheManager) -> None:
    """Raise IntegrityError (with the disagreeing numbers) if any invariant fails."""
    bs = mgr.block_size
    for g, pool in enumerate(mgr.pools):
        pool.check_integrity()
        holders = [0] * pool.num_blocks
        for rid, req in mgr._reqs.items():
            table = req.tables[g]
            want = -(-req.num_tokens // bs)
            if len(table) != want:
                raise IntegrityError(
                    f"request {rid!r} group {g}: expected {want} blocks for "
                    f"{req.num_tokens} tokens, got {len(table)}"
                )
            freed = req.freed[g]
            for i, bid in enumerate(table):
                if not 0 <= bid < pool.num_blocks:
                    raise IntegrityError(
                        f"request {rid!r} group {g}: block id expected in "
                        f"[0, {pool.num_blocks}), got {bid}"
                    )
                if (bid == 0) != (i < freed):
                    raise IntegrityError(
                        f"request {rid!r} group {g}: table[{i}] = {bid} but the "
                        f"window-freed prefix is {freed} blocks"
                    )
                holders[bid] += 1
            if mgr.enable_prefix_caching and len(req.hashes) != req.num_committed:
                raise IntegrityError(
                    f"request {rid!r}: expected {req.num_committed} block hashes, "
                    f"got {len(req.hashes)}"
                )
        for b in pool.blocks[1:]:
            if b.ref_cnt != holders[b.block_id]:
                raise IntegrityError(
                    f"group {g} block {b.block_id}: ref_cnt {b.ref_cnt} but "
                    f"{holders[b.block_id]} block tables hold it"
                )
        if pool.num_used > pool.num_usable or pool.num_free < 0:
            raise IntegrityError(
                f"group {g}: used {pool.num_used} / free {pool.num_free} out of "
                f"{pool.num_usable} blocks"
            )
