"""Whole-manager invariant checks (used by ``KVCacheManager.check_integrity`` and tests).

Checked, per KV group: the pool's own invariants (``BlockPool.check_integrity``); every
block's ``ref_cnt`` equals the number of request block tables holding it; each table has
``ceil(num_tokens / block_size)`` entries, null (0) exactly on the sliding-window-freed
prefix; each request's committed-hash count is consistent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpage.cache.allocation import RequestBlocks
from kvpage.cache.block_pool import BlockPool
from kvpage.errors import IntegrityError


def check_manager_integrity(
    pools: Sequence[BlockPool],
    requests: Mapping[str, RequestBlocks],
    block_size: int,
    enable_prefix_caching: bool,
) -> None:
    """Raise IntegrityError (with the disagreeing numbers) if any invariant fails.

    Args:
        pools: the manager's pools, one per KV group.
        requests: request id -> its record (tables, token count, hashes).
        block_size: tokens per block.
        enable_prefix_caching: whether committed hashes are tracked.
    """
    bs = block_size
    for g, pool in enumerate(pools):
        pool.check_integrity()
        holders = [0] * pool.num_blocks
        for rid, req in requests.items():
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
            if enable_prefix_caching and len(req.hashes) != req.num_committed:
                raise IntegrityError(
                    f"request {rid!r}: expected {req.num_committed} block hashes, "
                    f"got {len(req.hashes)}"
                )
        for bid in range(1, pool.num_blocks):
            ref = pool.ref_count(bid)
            if ref != holders[bid]:
                raise IntegrityError(
                    f"group {g} block {bid}: ref_cnt {ref} but {holders[bid]} block tables hold it"
                )
        if pool.num_used > pool.num_usable or pool.num_free < 0:
            raise IntegrityError(
                f"group {g}: used {pool.num_used} / free {pool.num_free} out of "
                f"{pool.num_usable} blocks"
            )
