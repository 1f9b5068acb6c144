"""Prefix-cache lookup over the KV groups of a model (the table a hit takes in one group
is :meth:`kvpage.cache.group_managers.GroupManager.hit_block_ids`).

A hit of ``nb`` blocks is usable when every full-attention group holds blocks
``0 .. nb-1`` and every sliding-window group (window ``W``) holds the blocks that the
first computed token (position ``nb * block_size``) can see: from
``max(0, nb*block_size - W + 1) // block_size`` to ``nb - 1``. Full groups make the hit
monotone (a contiguous run from block 0); sliding groups do not, so the longest hit is
searched downwards.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpage.cache.group_managers import GroupManager
from kvpage.cache.hashing import BlockHash, iter_block_hashes


def longest_hit(
    groups: Sequence[GroupManager],
    root: BlockHash,
    extra: bytes,
    token_ids: Sequence[int],
    block_size: int,
) -> tuple[int, list[BlockHash]]:
    """Blocks of the longest usable prefix hit, leaving >= 1 token to compute.

    Hashes are computed lazily and stop at the first miss of a full group. No state
    changes.

    Returns:
        ``(nb, hashes)``: the hit in blocks, and the chained hashes computed on the way
        (at least ``nb`` of them; reusable by the allocation that takes the hit).
    """
    bs = block_size
    cap = (len(token_ids) - 1) // bs
    full = [g.pool for g in groups if g.window is None]
    sliding = [g for g in groups if g.window is not None]
    hashes: list[BlockHash] = []
    for h in iter_block_hashes(root, extra, token_ids, bs, 0, cap):
        if not all(p.is_cached(h) for p in full):
            break
        hashes.append(h)
    hb = len(hashes)
    if not sliding or hb == 0:
        return hb, hashes
    runs = []  # per sliding group: length of the cached run ending at each block
    for g in sliding:
        run, r = 0, []
        for h in hashes:
            run = run + 1 if g.pool.is_cached(h) else 0
            r.append(run)
        runs.append(r)
    for nb in range(hb, 0, -1):
        if all(r[nb - 1] >= nb - g.first_needed_block(nb * bs) for r, g in zip(runs, sliding)):
            return nb, hashes
    return 0, hashes


__all__ = ["longest_hit"]
