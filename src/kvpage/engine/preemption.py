"""Preemption of a running sequence (:class:`Preemptor`): its blocks are freed and it
goes back to the front of the waiting queue, its progress either dropped (recompute) or
its K/V copied to host memory and back on readmission (swap, through
``kvpage.engine.swap``). The scheduler decides *who* is preempted; this object carries
it out and owns the swapper and the preemption count.

On a hybrid model (an allocator whose ``state`` is a ``StatePool``) a swap also moves
the sequence's live state slot. Before the swapper reads or writes a live slot, the
state slot copies queued so far (``take_state_copies``: snapshots of the last step,
restores, forks) are run, in order, through the swapper's state mover: the ordered
copy queue of docs/architecture.md ("Recurrent state") then holds as if the swap were
one more entry in it — the slot read holds the state after the victim's computed
tokens, and a queued copy out of a slot taken by a swapped-in sequence still reads what
it was queued for."""

from __future__ import annotations

from kvpage.cache.allocation import Allocation
from kvpage.cache.protocol import KVAllocator, StateAllocator, SwapAllocator
from kvpage.engine.queue_policy import FCFSQueue, PriorityQueue
from kvpage.engine.request import Request, RequestStatus
from kvpage.engine.swap import Swapper
from kvpage.errors import SpecError

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
        self._swapper: Swapper | None = None
        self.num_preemptions = 0
        self._stateful = kv if isinstance(kv, StateAllocator) and kv.state is not None else None

    @property
    def swapper(self) -> Swapper | None:
        """Swap preemption; None = always recompute."""
        return self._swapper

    @swapper.setter
    def swapper(self, swapper: Swapper | None) -> None:
        """Set the swapper.

        Raises:
            SpecError: a swapper for an allocator without swap support (no
                ``SwapAllocator``), one without a state mover for an allocator with
                recurrent state, or one with a state mover for an allocator without
                (unchanged).
        """
        if swapper is not None and not isinstance(self.kv, SwapAllocator):
            raise SpecError(
                f"swapper: expected an allocator with swap support (SwapAllocator), got "
                f"{type(self.kv).__name__}"
            )
        if swapper is not None and (swapper.state is None) != (self._stateful is None):
            raise SpecError(
                f"swapper.state: expected {'a state mover' if self._stateful else 'none'} "
                f"(the allocator {'holds' if self._stateful else 'holds no'} recurrent "
                f"state), got {'none' if swapper.state is None else 'one'}"
            )
        self._swapper = swapper

    def _state_slot_after_copies(self, request_id: str) -> int | None:
        """``request_id``'s live state slot after running every queued state slot copy
        (module docstring); None without state layers."""
        st = self._stateful
        if st is None:
            return None
        sw = self._swapper
        assert sw is not None and sw.state is not None  # checked by the setter
        sw.state.copy_slots(st.take_state_copies())
        return st.state_slot(request_id)

    def preempt(self, req: Request) -> None:
        """Free ``req``'s blocks (and live state slot) and requeue it at the front: its
        K/V (and recurrent state) are swapped out to host memory when :attr:`swapper`
        takes them, else recomputed later."""
        sw = self.swapper
        if sw is not None and req.num_computed_tokens:
            rid, n = req.request_id, req.num_computed_tokens
            blocks = self._swap_kv.swap_blocks(rid, n)
            # running the queued state copies early is harmless when the swapper declines
            if sw.swap_out(rid, blocks, n, state_slot=self._state_slot_after_copies(rid)):
                req.swapped_tokens = n
        self.kv.free(req.request_id)
        req.has_blocks = False
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    @property
    def _swap_kv(self) -> SwapAllocator:
        """The allocator as a ``SwapAllocator`` (checked by the :attr:`swapper` setter)."""
        kv = self.kv
        assert isinstance(kv, SwapAllocator)
        return kv

    def allocate_swapped(self, req: Request, num_new_tokens: int) -> Allocation | None:
        """The readmission of swapped-out ``req``: room for its ``swapped_tokens`` (the
        blocks a continuation needs, per KV group, ``SwapAllocator.allocate_swapped``)
        and ``num_new_tokens`` more; None when that does not fit (nothing changed).
        Call :meth:`swap_in` after it, before the step runs."""
        return self._swap_kv.allocate_swapped(
            req.request_id,
            req.token_ids,
            req.swapped_tokens,
            num_new_tokens,
            cache_salt=req.cache_salt,
        )

    def swap_in(self, req: Request) -> None:
        """Copy a readmitted request's swapped K/V into its new blocks (per KV group,
        those at the positions swapped out) and its swapped recurrent state into its
        new live slot, before the step that continues it runs."""
        assert self.swapper is not None
        rid = req.request_id
        tiers = getattr(self.kv, "tiers", None)
        if tiers is not None:
            tiers.flush()  # the new blocks may be pending demotions: copy them out first
        slot = self._state_slot_after_copies(rid)
        blocks = self._swap_kv.swap_blocks(rid, req.swapped_tokens)
        self.swapper.swap_in(rid, blocks, state_slot=slot)
        req.swapped_tokens = 0

    def discard_swap(self, req: Request) -> None:
        """Drop a finished request's swapped K/V (no-op without a swapper)."""
        if self.swapper is not None:
            self.swapper.discard(req.request_id)
        req.swapped_tokens = 0
