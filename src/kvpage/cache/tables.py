"""Step tensors derived from block tables: slot mapping and the batched block table.

Slot of the token at position ``p``: ``kvpage.slots.slot_of`` (the one
definition). Block tables are padded with ``PAD_BLOCK`` (-1), never written or read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpage.errors import ShapeError
from kvpage.slots import PAD_BLOCK, slot_of


def slot_mapping(
    block_table: Sequence[int], start: int, num_tokens: int, block_size: int
) -> np.ndarray:
    """Slots of the tokens at positions ``start .. start + num_tokens - 1``.

    Args:
        block_table: physical block ids of one sequence (one KV group), position order.
        start: absolute position of the first token (e.g. the number of cached tokens
            for a resumed or chunked prefill, C07).
        num_tokens: tokens to map (>= 0).
        block_size: tokens per block (>= 1).

    Returns:
        ``[num_tokens]`` int64 slots.

    Raises:
        ShapeError: negative ``start``/``num_tokens``, ``block_size < 1``, or a position
            past the end of ``block_table``.
    """
    if start < 0 or num_tokens < 0 or block_size < 1:
        raise ShapeError(
            f"slot_mapping: expected start >= 0, num_tokens >= 0, block_size >= 1, "
            f"got {start}, {num_tokens}, {block_size}"
        )
    if num_tokens == 0:
        return np.empty(0, dtype=np.int64)
    end = start + num_tokens
    if (end - 1) // block_size >= len(block_table):
        raise ShapeError(
            f"block_table: expected >= {(end - 1) // block_size + 1} blocks for positions "
            f"up to {end - 1}, got {len(block_table)}"
        )
    pos = np.arange(start, end, dtype=np.int64)
    first = start // block_size
    last = (end - 1) // block_size
    bt = np.asarray(block_table[first : last + 1], dtype=np.int64)
    return slot_of(bt[pos // block_size - first], pos, block_size)


def batch_block_tables(tables: Sequence[Sequence[int]], pad: int = PAD_BLOCK) -> np.ndarray:
    """Stack per-sequence block tables into one padded array.

    Args:
        tables: one block table per sequence (lengths may differ).
        pad: value of entries past a sequence's last block.

    Returns:
        ``[num_seqs, max_blocks_per_seq]`` int32 (``[0, 0]`` for no sequences).
    """
    n = len(tables)
    width = max(map(len, tables), default=0)
    out = np.full((n, width), pad, dtype=np.int32)
    for i, t in enumerate(tables):
        if t:
            out[i, : len(t)] = t
    return out


__all__ = ["batch_block_tables", "slot_mapping"]
