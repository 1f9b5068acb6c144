"""Priority in the server's KV-pressure queue and the degraded mode's long-context slots:
under ``scheduling_policy=priority`` waiting long requests are served by ``(priority,
arrival)`` (lower first, FCFS among equals), as the engine's own queue; under ``fcfs``
both stay FIFO. (Before: both were FIFO whatever the policy.)"""

from __future__ import annotations

import asyncio

import pytest

from kvpage.server.admission import KVBudget, PrioritySlots
from kvpage.server.config import AdmissionConfig


def _budget(policy: str) -> KVBudget:
    # 20 blocks, high water 0.5 (10 blocks), long = prompt >= 64 tokens
    cfg = AdmissionConfig(
        kv_high_water=0.5, long_prompt_tokens=64, kv_pressure_action="queue", queue_timeout_s=5.0
    )
    return KVBudget(num_blocks=20, block_size=16, config=cfg, policy=policy)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _admission_order(policy: str, arrivals: list[tuple[str, int]]) -> list[str]:
    """A long request holds 8 blocks; each arrival (name, priority) is a long request of
    6 blocks (8 + 6 > 10: waits); then the holder releases and every admitted one
    releases in turn: the order they got in."""
    kv = _budget(policy)
    assert (await kv.acquire(100, 8)).ok
    order: list[str] = []

    async def one(name: str, prio: int) -> None:
        d = await kv.acquire(80, 6, prio)
        assert d.ok, d
        order.append(name)

    tasks = []
    for name, prio in arrivals:
        tasks.append(asyncio.ensure_future(one(name, prio)))
        await _settle()  # arrival order = list order
    assert kv.num_queued == len(arrivals) and not order
    kv.release(8)
    for _ in arrivals:
        await _settle()
        assert order, "nobody admitted after a release"
        kv.release(6)  # the admitted one finishes; only one fits at a time
    await asyncio.gather(*tasks)
    assert kv.reserved_blocks == 0
    return order


ARRIVALS = [("low-a", 9), ("mid", 5), ("urgent", 0), ("low-b", 9), ("urgent-b", 0)]


def test_kv_pressure_queue_serves_by_priority_then_arrival():
    order = asyncio.run(_admission_order("priority", ARRIVALS))
    assert order == ["urgent", "urgent-b", "mid", "low-a", "low-b"]


def test_kv_pressure_queue_stays_fifo_under_fcfs():
    order = asyncio.run(_admission_order("fcfs", [(n, 0) for n, _ in ARRIVALS]))
    assert order == [n for n, _ in ARRIVALS]


def test_an_urgent_request_that_fits_passes_waiting_low_ones_but_not_equals():
    async def run(policy: str, prio: int) -> bool:
        kv = _budget(policy)
        assert (await kv.acquire(100, 8)).ok
        big = asyncio.ensure_future(kv.acquire(80, 12, 9))  # 8 + 12 > 10: waits
        await _settle()
        small = asyncio.ensure_future(kv.acquire(80, 2, prio))  # 8 + 2 fits
        await _settle()
        got_in = small.done() and small.result().ok
        kv.release(8)
        if got_in:
            kv.release(2)
        await _settle()
        assert big.done() and big.result().ok  # the big one is not starved
        if not got_in:
            assert not small.done()  # 12 + 2 > 10: still behind the big one
            kv.release(12)
            await _settle()
            assert small.result().ok
        return got_in

    assert asyncio.run(run("priority", 0))  # more urgent than every waiter: in at once
    assert not asyncio.run(run("priority", 9))  # same priority, later: behind it
    assert not asyncio.run(run("fcfs", 0))  # fcfs: strictly behind the waiter


def test_a_woken_waiter_cancelled_passes_the_wake_on():
    async def run() -> None:
        kv = _budget("priority")
        assert (await kv.acquire(100, 8)).ok
        first = asyncio.ensure_future(kv.acquire(80, 6, 0))
        await _settle()
        second = asyncio.ensure_future(kv.acquire(80, 6, 1))
        await _settle()
        kv.release(8)  # wakes `first` ...
        first.cancel()  # ... which is cancelled before it resumes
        try:
            got_first = (await first).ok  # Python 3.11's wait_for may keep the result
        except asyncio.CancelledError:
            got_first = False
        await _settle()
        # either way exactly one holds the budget: the wake was not lost
        assert kv.reserved_blocks == 6
        assert second.done() != got_first
        if got_first:
            kv.release(6)
            await _settle()
            assert second.done() and second.result().ok

    asyncio.run(run())


def _slot_order(policy: str, arrivals: list[tuple[str, int]]) -> list[str]:
    async def run() -> list[str]:
        slots = PrioritySlots(1, policy)
        await slots.acquire()  # held
        order: list[str] = []

        async def one(name: str, prio: int) -> None:
            await slots.acquire(prio)
            order.append(name)
            await asyncio.sleep(0)
            slots.release()

        tasks = []
        for name, prio in arrivals:
            tasks.append(asyncio.ensure_future(one(name, prio)))
            await _settle()
        assert slots.num_waiting == len(arrivals)
        slots.release()
        await asyncio.gather(*tasks)
        assert slots.free == 1 and slots.num_waiting == 0
        return order

    return asyncio.run(run())


def test_long_context_slots_serve_by_priority_then_arrival():
    assert _slot_order("priority", ARRIVALS) == ["urgent", "urgent-b", "mid", "low-a", "low-b"]
    assert _slot_order("fcfs", [(n, 0) for n, _ in ARRIVALS]) == [n for n, _ in ARRIVALS]


def test_long_context_slot_timeout_takes_nothing_and_a_handed_slot_moves_on():
    async def run() -> None:
        slots = PrioritySlots(1, "priority")
        await slots.acquire()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slots.acquire(0), 0.01)
        assert slots.num_waiting == 0 and slots.free == 0
        a = asyncio.ensure_future(slots.acquire(0))
        await _settle()
        b = asyncio.ensure_future(slots.acquire(5))
        await _settle()
        slots.release()  # handed to a ...
        a.cancel()  # ... cancelled before it resumed: b gets the slot
        with pytest.raises(asyncio.CancelledError):
            await a
        await asyncio.wait_for(b, 1)
        slots.release()
        assert slots.free == 1
        with pytest.raises(ValueError, match="slots: expected >= 1"):
            PrioritySlots(0)

    asyncio.run(run())
