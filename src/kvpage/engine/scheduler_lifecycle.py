"""The sequence lifecycle of :class:`~kvpage.engine.scheduler.Scheduler` outside a
step's plan: preemption (recompute, or swap through ``kvpage.engine.swap``), forking of
parallel samples, finishing, aborting and forgetting requests, and the queue counts.
A base class split from scheduler.py to keep modules small; the state it uses is set
up by ``Scheduler.__init__``."""

from __future__ import annotations

from kvpage.cache.protocol import KVAllocator
from kvpage.engine.queue_policy import FCFSQueue, PriorityQueue
from kvpage.engine.request import Request, RequestStatus, sample_id
from kvpage.engine.swap import Swapper


class SequenceLifecycle:
    """Preemption, swap, forks and finishing of a
    :class:`~kvpage.engine.scheduler.Scheduler` (see there)."""

    # state owned by Scheduler.__init__
    kv: KVAllocator
    waiting: FCFSQueue | PriorityQueue
    running: list[Request]
    requests: dict[str, Request]
    samples: dict[str, list[Request]]
    num_preemptions: int
    swapper: Swapper | None

    def _preempt(self, req: Request) -> None:
        """Free ``req``'s blocks and requeue it at the front: its K/V are swapped out to
        host memory when :attr:`swapper` takes them (``kvpage.engine.swap``), else
        recomputed later."""
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

    def _swap_in(self, req: Request) -> None:
        """Copy a readmitted request's swapped K/V into its new blocks (before the step
        that continues it runs)."""
        assert self.swapper is not None
        nb = -(-req.swapped_tokens // self.kv.block_size)
        tiers = getattr(self.kv, "tiers", None)
        if tiers is not None:
            tiers.flush()  # the new blocks may be pending demotions: copy them out first
        self.swapper.swap_in(req.request_id, self.kv.block_table(req.request_id, 0)[:nb])
        req.swapped_tokens = 0

    def _fork(self, parent: Request) -> list[Request]:
        """Create the parent's pending samples, sharing its blocks (copy-on-write)."""
        k = parent.num_pending_samples
        if k == 0:
            return []
        parent.num_pending_samples = 0
        children = []
        pos = self.running.index(parent) + 1
        for idx in range(1, k + 1):
            child = Request(
                request_id=sample_id(parent.parent_id, idx),
                parent_id=parent.parent_id,
                sample_index=idx,
                token_ids=list(parent.token_ids),
                num_prompt_tokens=parent.num_prompt_tokens,
                params=parent.params,
                max_tokens=parent.max_tokens,
                eos_token_id=parent.eos_token_id,
                cache_salt=parent.cache_salt,
                arrival_order=parent.arrival_order,
                priority=parent.priority,
                status=RequestStatus.RUNNING,
                num_computed_tokens=parent.num_computed_tokens,
                num_cached_tokens=parent.num_cached_tokens,
                has_blocks=True,
                stop_token_set=parent.stop_token_set,
                cache_miss=parent.cache_miss,
            )
            self.kv.fork(parent.request_id, child.request_id)
            self.requests[child.request_id] = child
            self.samples[parent.parent_id].append(child)
            children.append(child)
        self.running[pos:pos] = children
        return children

    # ---- finishing ----------------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> None:
        """Mark ``req`` finished with ``reason`` and free its blocks (idempotent)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.has_blocks:
            self.kv.free(req.request_id)
            req.has_blocks = False
        if req.swapped_tokens and self.swapper is not None:
            self.swapper.discard(req.request_id)
            req.swapped_tokens = 0
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def abort(self, parent_id: str) -> list[Request]:
        """Abort every sample of user request ``parent_id`` and free their blocks now.

        Returns the aborted sequences (empty for an unknown or finished id)."""
        seqs = self.samples.get(parent_id, [])
        out = [r for r in seqs if not r.is_finished]
        for r in out:
            self.finish(r, "abort")
            r.num_pending_samples = 0
        return out

    @property
    def groups(self) -> dict[str, list[Request]]:
        """Deprecated alias of :attr:`samples`."""
        return self.samples

    def group_finished(self, parent_id: str) -> bool:
        """Deprecated alias of :meth:`samples_finished`."""
        return self.samples_finished(parent_id)

    def samples_finished(self, parent_id: str) -> bool:
        """True when every sample of ``parent_id`` has finished (and none is pending)."""
        for r in self.samples[parent_id]:  # a loop: this runs per request per step
            if r.status is not RequestStatus.FINISHED or r.num_pending_samples:
                return False
        return True

    def release(self, parent_id: str) -> None:
        """Forget a finished user request (its sequences and ids)."""
        for r in self.samples.pop(parent_id, []):
            self.requests.pop(r.request_id, None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)


__all__ = ["SequenceLifecycle"]
