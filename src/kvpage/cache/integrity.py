"""Whole-manager invariant checks (used by ``KVCacheManager.check_integrity`` and tests).

Checked, per KV group: the pool's own invariants (``BlockPool.check_integrity``); every
block's ``ref_cnt`` equals the number of request block tables holding it; each table has
``ceil(num_tokens / block_size)`` entries, null (0) exactly on the sliding-window-freed
prefix; each request's committed-hash count is consistent. With a unified pool the
ref counts are summed over every group's tables and each held block must hold the
content of the group whose table holds it (``KVBlock.group``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvpage.cache.allocation import RequestBlocks
from kvpage.cache.block_pool import BlockPool, GroupPool
from kvpage.errors import IntegrityError


def check_manager_integrity(
    pools: Sequence[BlockPool | GroupPool],
    requests: Mapping[str, RequestBlocks],
    block_size: int,
    enable_prefix_caching: bool,
    shared: BlockPool | None = None,
) -> None:
    """Raise IntegrityError (with the disagreeing numbers) if any invariant fails.

    Args:
        pools: the manager's pools (or views of ``shared``), one per KV group.
        requests: request id -> its record (tables, token count, hashes).
        block_size: tokens per block.
        enable_prefix_caching: whether committed hashes are tracked.
        shared: the pool every group shares (unified), None for per-group pools.
    """
    if shared is not None:
        _check_tables(pools, requests, block_size, enable_prefix_caching, shared)
        return
    bs = block_size
    for g, pool in enumerate(pools):
        pool.check_integrity()
        holders = [0] * pool.num_blocks
        for rid, req in requests.items():
            for bid in _checked_table(rid, req, g, bs, pool.num_blocks):
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


def _checked_table(
    rid: str, req: RequestBlocks, g: int, block_size: int, num_blocks: int
) -> list[int]:
    """Group ``g``'s block table of request ``rid`` after checking its length
    (``ceil(num_tokens / block_size)``), its ids (in ``[0, num_blocks)``) and that the
    null block stands exactly on the window-freed prefix."""
    table = req.tables[g]
    want = -(-req.num_tokens // block_size)
    if len(table) != want:
        raise IntegrityError(
            f"request {rid!r} group {g}: expected {want} blocks for "
            f"{req.num_tokens} tokens, got {len(table)}"
        )
    freed = req.freed[g]
    for i, bid in enumerate(table):
        if not 0 <= bid < num_blocks:
            raise IntegrityError(
                f"request {rid!r} group {g}: block id expected in [0, {num_blocks}), got {bid}"
            )
        if (bid == 0) != (i < freed):
            raise IntegrityError(
                f"request {rid!r} group {g}: table[{i}] = {bid} but the "
                f"window-freed prefix is {freed} blocks"
            )
    return list(table)


def _check_tables(
    pools: Sequence[BlockPool | GroupPool],
    requests: Mapping[str, RequestBlocks],
    block_size: int,
    enable_prefix_caching: bool,
    shared: BlockPool,
) -> None:
    """The unified-pool form of :func:`check_manager_integrity`."""
    shared.check_integrity()
    n = shared.num_blocks
    holders = [0] * n
    owner = [-1] * n
    for rid, req in requests.items():
        if enable_prefix_caching and len(req.hashes) != req.num_committed:
            raise IntegrityError(
                f"request {rid!r}: expected {req.num_committed} block hashes, got {len(req.hashes)}"
            )
        for g in range(len(pools)):
            for bid in _checked_table(rid, req, g, block_size, n):
                if bid == 0:
                    continue
                if owner[bid] not in (-1, g) or shared.group_of(bid) != g:
                    raise IntegrityError(
                        f"block {bid}: held by group {g} but holds group "
                        f"{shared.group_of(bid)}'s content (other holder: group {owner[bid]})"
                    )
                owner[bid] = g
                holders[bid] += 1
    for bid in range(1, n):
        ref = shared.ref_count(bid)
        if ref != holders[bid]:
            raise IntegrityError(
                f"shared pool block {bid}: ref_cnt {ref} but {holders[bid]} block tables hold it"
            )
