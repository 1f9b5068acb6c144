"""What one sequence computes in a step (:class:`ScheduledRequest`), as the
scheduler (:mod:`kvpage.engine.scheduler`) plans it and the model runner reads it."""

from __future__ import annotations

from dataclasses import dataclass

from kvpage.attention.metadata import slots_of
from kvpage.engine.request import Request

__all__ = ["ScheduledRequest"]


@dataclass(slots=True)
class ScheduledRequest:
    """What one sequence computes in a step.

    Attributes:
        request: the sequence (read its ids and params; the scheduler owns it).
        start: absolute position of the first token computed (= tokens already cached).
        num_tokens: tokens computed this step (>= 1); positions ``start .. start+n-1``.
        token_ids: those tokens' ids.
        block_tables: one block table per KV group (physical block ids).
        samples: True when this step computes the last known token, so the model's
            logits at it are sampled (False for a non-final prefill chunk).
        draft_token_ids: speculative draft tokens computed after the last known token
            (``token_ids[1:]``; empty = none): the logits at every position are
            verified (``kvpage.engine.spec_decode``).
    """

    request: Request
    start: int
    num_tokens: int
    token_ids: list[int]
    block_tables: list[list[int]]
    samples: bool
    draft_token_ids: list[int] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_samples(self) -> int:
        """Tokens to sample for this sequence: ``n`` when it forks now, else 1 (0 when
        it does not sample)."""
        if not self.samples:
            return 0
        return 1 + self.request.num_pending_samples

    def slot_mapping(self, group: int, block_size: int) -> list[int]:
        """Slots of the computed tokens in KV group ``group``
        (``kvpage.attention.metadata.slots_of``)."""
        return slots_of(
            self.block_tables[group], self.start, self.start + self.num_tokens, block_size
        )
