"""Preemption of a running sequence (:class:`Preemptor`): its blocks are freed and it
goes back to the front of the waiting queue, its progress either dropped (recompute) or
its K/V copied to host memory and back on readmission (swap, through
``kvpage.engine.swap``). The scheduler decides *who* is preempted; this object carries
it out and owns the swapper and the preemption count."""

from __future__ import annotations

from kvpage.cache.protocol import KVAllocator
from kvpage.engine.queue_policy import FCFSQueue, PriorityQueue
from kvpage.engine.request import Request, RequestStatus
from kvpage.engine.swap import Swapper

__all__ = ["Preemptor"]


class Preemptor:
    """Carries out preemptions for a :class:`~kvpage.engine.scheduler.Scheduler`.

    Args:
        kv: the scheduler's allocator (blocks are freed and tables read through it).
        waiting: the scheduler's waiting queue (victims are put back at its front).

    Attributes:
        swapper: swap preemption (``kvpage.engine.swap.Swapper``); None = always
            recompute.
        num_preemptions: preemptions since the start.
    """

    def __init__(self, kv: KVAllocator, waiting: FCFSQueue | PriorityQueue) -> None:
        self.kv = kv
        self.waiting = waiting
        self.swapper: Swapper | None = None
        self.num_preemptions = 0

    def preempt(self, req: Request) -> None:
        """Free ``req``'s blocks and requeue it at the front: its K/V are swapped out to
        host memory when :attr:`swapper` takes them, else recomputed later."""
        sw = self.swapper
        if sw is not None and req.num_computed_tokens:
            table = self.kv.block_table(req.request_id, 0)
            if sw.swap_out(req.request_id, table, req.num_computed_tokens):
                req.swapped_tokens = req.num_computed_tokens
        self.kv.free(req.request_id)
        req.has_blocks = False
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def swap_in(self, req: Request) -> None:
        """Copy a readmitted request's swapped K/V into its new blocks (before the step
        that continues it runs)."""
        assert self.swapper is not None
        nb = -(-req.swapped_tokens // self.kv.block_size)
        tiers = getattr(self.kv, "tiers", None)
        if tiers is not None:
            tiers.flush()  # the new blocks may be pending demotions: copy them out first
        self.swapper.swap_in(req.request_id, self.kv.block_table(req.request_id, 0)[:nb])
        req.swapped_tokens = 0

    def discard_swap(self, req: Request) -> None:
        """Drop a finished request's swapped K/V (no-op without a swapper)."""
        if self.swapper is not None:
            self.swapper.discard(req.request_id)
        req.swapped_tokens = 0
