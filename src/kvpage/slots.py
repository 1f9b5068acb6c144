"""The slot formula and block-table padding: the one definition, below both the cache
(block tables, slot mappings) and the attention backends (which must not import the
cache). Re-exported by :mod:`kvpage.attention.metadata`.

Slot of the token at absolute position ``p`` of a sequence whose block table is ``bt``:
``bt[p // block_size] * block_size + p % block_size`` (PagedAttention, Kwon et al., SOSP
2023; vLLM's ``slot_mapping``). A padding slot is -1 and is never written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

#: block-table padding (an entry past a sequence's blocks); never read or written
PAD_BLOCK = -1

_IndexT = TypeVar("_IndexT", int, "torch.Tensor", "np.ndarray")


def slot_of(block_id: _IndexT, position: _IndexT, block_size: int) -> _IndexT:
    """The cache slot of the token at absolute ``position`` stored in physical block
    ``block_id`` (``= block_table[position // block_size]``):
    ``block_id * block_size + position % block_size``. Elementwise for int64 numpy
    arrays and torch tensors (same shapes or broadcastable)."""
    return block_id * block_size + position % block_size  # type: ignore[no-any-return]


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``start .. end - 1`` of one sequence (``slot_of`` per
    position) as a host list; ``block_table`` must cover position ``end - 1``."""
    return [slot_of(block_table[p // block_size], p, block_size) for p in range(start, end)]


__all__ = ["PAD_BLOCK", "slot_of", "slots_of"]
