"""Scheduling policies: the order of the waiting queue and of the running batch.

``fcfs`` (the default) serves requests in arrival order: the waiting queue is a FIFO,
a preempted sequence goes back to its front, and the preemption victim is the newest
admitted running sequence (:class:`FCFSQueue`).

``priority`` (vLLM's ``--scheduling-policy priority``) serves requests by
``(priority, arrival order)``: a **lower value is served first**, first come first served
among equal priorities. The waiting queue is a heap on that key (a preempted sequence
goes back in by its key, so it stays ahead of later arrivals of its priority), and the
running batch is kept sorted on it at the start of every step
(:meth:`PriorityQueue.order_running`), so the scheduler's rule "preempt the last running
sequence" picks the **lowest priority, newest arrival** first (vLLM's victim
``max(running, key=(priority, arrival))``). Source of the semantics: vLLM
``SchedulerConfig.policy`` and the V1 scheduler (docs.vllm.ai, v0.10-v0.28).

Like vLLM V1, a waiting request of higher priority does not force a running request of
lower priority out: it is admitted first once the batch has room, and under KV pressure
the lowest priorities are preempted first. Strict priority can starve: while requests of
a higher priority keep the batch full, lower ones wait (no ageing; see docs/serving.md).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from kvpage.engine.request import Request
from kvpage.errors import RequestRejected, SpecError
from kvpage.specs.engine_config import SCHEDULING_POLICIES, SchedulingPolicy

__all__ = [
    "SCHEDULING_POLICIES",
    "FCFSQueue",
    "PriorityQueue",
    "SchedulingPolicy",
    "check_priority",
    "make_queue",
    "priority_key",
]


def priority_key(req: Request) -> tuple[int, int, int]:
    """``(priority, arrival order, sample index)``: smaller is served first."""
    return (req.priority, req.arrival_order, req.sample_index)


class FCFSQueue(deque[Request]):
    """The FIFO waiting queue (a ``deque``): ``append`` queues a new request,
    ``appendleft`` puts a preempted one back at the front, ``popleft`` admits the head."""

    policy: SchedulingPolicy = "fcfs"

    def order_running(self, running: list[Request]) -> None:
        """FCFS keeps the running batch in admission order (no-op)."""


class PriorityQueue:
    """The waiting queue of the ``priority`` policy: a heap on :func:`priority_key`.

    It offers the ``deque`` subset the scheduler uses, with priority semantics:
    ``append`` and ``appendleft`` (a preempted request) both insert by key, ``[0]`` and
    ``popleft`` give the smallest key. ``remove`` is O(n) (aborts of waiting requests).
    """

    policy: SchedulingPolicy = "priority"

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, int, int], int, Request]] = []
        self._tie = 0  # never reached for distinct sequences; keeps Requests uncompared

    def append(self, req: Request) -> None:
        """Queue ``req`` by its key."""
        self._tie += 1
        heapq.heappush(self._heap, (priority_key(req), self._tie, req))

    appendleft = append  # a preempted request also goes back in by its key

    def popleft(self) -> Request:
        """Remove and return the request served next (IndexError when empty)."""
        return heapq.heappop(self._heap)[2]

    def __getitem__(self, index: int) -> Request:
        if index != 0:
            raise IndexError("PriorityQueue: only [0] (the head) is indexable")
        return self._heap[0][2]

    def remove(self, req: Request) -> None:
        """Remove ``req`` (ValueError when absent)."""
        for i, item in enumerate(self._heap):
            if item[2] is req:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("PriorityQueue.remove(x): x not in queue")

    def __contains__(self, req: object) -> bool:
        return any(item[2] is req for item in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """The queued requests in service order."""
        return (item[2] for item in sorted(self._heap))

    def order_running(self, running: list[Request]) -> None:
        """Sort the running batch by :func:`priority_key` in place (stable; nearly
        sorted already, so O(n) per step): the most urgent sequences get the step's
        token budget first and the last one is the preemption victim."""
        running.sort(key=priority_key)


def check_priority(priority: object, policy: str) -> None:
    """Check a request's ``priority`` for ``policy``.

    Raises:
        RequestRejected: reason ``"invalid_request"``: not an int (bools refused), or
            non-zero under ``fcfs`` (vLLM refuses that too: it would be ignored).
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestRejected(
            f"priority: expected an int (lower is served first), got {priority!r}",
            reason="invalid_request",
        )
    if priority != 0 and policy != "priority":
        raise RequestRejected(
            f"priority: expected 0 (the engine's scheduling_policy is {policy!r}; build it "
            f"with scheduling_policy='priority' to use priorities), got {priority}",
            reason="invalid_request",
        )


def make_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The waiting queue of ``policy`` ("fcfs" or "priority").

    Raises:
        SpecError: an unknown policy.
    """
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise SpecError(f"scheduling_policy: expected 'fcfs' or 'priority', got {policy!r}")
