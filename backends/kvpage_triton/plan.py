"""The Triton backend's step plan (pure torch; no triton import)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpage.attention.metadata import AttentionMetadata
from kvpage.attention.plan import StepPlan, step_fields


@dataclass(frozen=True, kw_only=True)
class TritonPlan(StepPlan):
    """A validated step and its query tile lists.

    Query tiles depend on ``BLOCK_Q``, which depends on the layer's GQA group, so they
    are built on first use per ``block_q`` (``tiles``) from host lists (no device sync)
    and shared by every later layer of the step.
    """

    tile_memo: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @classmethod
    def from_meta(cls, meta: AttentionMetadata) -> TritonPlan:
        """Validate the step (``kvpage.attention.plan.check_step``).

        Raises:
            ShapeError, DTypeError: see ``check_step``.
        """
        return cls(**step_fields(meta))

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query tile of ``block_q`` rows: (sequence, first query index) as int32
        tensors on the step's device."""
        hit = self.tile_memo.get(block_q)
        if hit is None:
            seqs: list[int] = []
            starts: list[int] = []
            for i, q in enumerate(self.meta.query_lens_cpu):
                for s in range(0, q, block_q):
                    seqs.append(i)
                    starts.append(s)
            hit = (
                torch.tensor(seqs, dtype=torch.int32, device=self.device),
                torch.tensor(starts, dtype=torch.int32, device=self.device),
            )
            self.tile_memo[block_q] = hit
        return hit
