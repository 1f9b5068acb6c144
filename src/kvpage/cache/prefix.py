"""Prefix-cache lookup over the KV groups of a model.

A hit of ``nb`` blocks is usable when every full-attention group holds blocks
``0 .. nb-1`` and every sliding-window group (window ``W``) holds the blocks that the
first computed token (position ``nb * block_size``) can see: from
``max(0, nb*block_size - W + 1) // block_size`` to ``nb - 1``. Full groups make the hit
monotone (a contiguous run from block 0); sliding groups do not, so the longest hit is
searched downwards.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpage.cache.block_pool import NULL_BLOCK_ID, BlockPool
from kvpage.cache.hashing import BlockHash, iter_block_hashes


def longest_hit(
    pools: Sequence[BlockPool],
    windows: Sequence[int | None],
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
    full = [pools[g].cached for g, w in enumerate(windows) if w is None]
    sliding = [(pools[g].cached, w) for g, w in enumerate(windows) if w is not None]
    hashes: list[BlockHash] = []
    for h in iter_block_hashes(root, extra, token_ids, bs, 0, cap):
        if any(h not in c for c in full):
            break
        hashes.append(h)
    hb = len(hashes)
    if not sliding or hb == 0:
        return hb, hashes
    runs = []  # per sliding group: length of the cached run ending at each block
    for cached, _ in sliding:
        run, r = 0, []
        for h in hashes:
            run = run + 1 if h in cached else 0
            r.append(run)
        runs.append(r)
    for nb in range(hb, 0, -1):
        if all(r[nb - 1] >= nb - max(0, nb * bs - w + 1) // bs for r, (_, w) in zip(runs, sliding)):
            return nb, hashes
    return 0, hashes


def hit_blocks(
    pools: Sequence[BlockPool],
    windows: Sequence[int | None],
    hashes: Sequence[BlockHash],
    num_cached_tokens: int,
    block_size: int,
) -> list[list[int]] | str:
    """Per group, the block ids a hit of ``num_cached_tokens`` takes (null block 0 for
    blocks a sliding group does not need), or a reason string if the hit is not usable.
    No state changes."""
    nb = num_cached_tokens // block_size
    out: list[list[int]] = []
    for g, w in enumerate(windows):
        lo = 0 if w is None else max(0, num_cached_tokens - w + 1) // block_size
        cached = pools[g].cached
        ids = [NULL_BLOCK_ID] * lo
        for i in range(lo, nb):
            b = cached.get(hashes[i])
            if b is None:
                return f"block {i} of group {g} is not cached"
            ids.append(b.block_id)
        out.append(ids)
    return out


__all__ = ["hit_blocks", "longest_hit"]
