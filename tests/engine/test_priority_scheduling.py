"""The ``priority`` scheduling policy: admission order, preemption victims, the API.

Semantics (vLLM's ``--scheduling-policy priority``): lower value first, FCFS among
equals, victims are the lowest priority (then newest) running sequences.
"""

from __future__ import annotations

import pytest
from test_scheduler import make, run, step

from kvpage.engine import LLM, LLMEngine, Request, SamplingParams, Scheduler
from kvpage.engine.queue_policy import FCFSQueue, PriorityQueue, make_queue
from kvpage.errors import RequestRejected, SpecError


def preq(rid: str, priority: int, prompt: int = 16, max_tokens: int = 4) -> Request:
    ids = list(range(100, 100 + prompt))
    return Request(
        request_id=rid,
        parent_id=rid,
        sample_index=0,
        token_ids=ids,
        num_prompt_tokens=len(ids),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        max_tokens=max_tokens,
        priority=priority,
    )


def admission_order(s: Scheduler) -> list[str]:
    order: list[str] = []
    while s.has_unfinished():
        out, _ = step(s)
        order += [x.request_id for x in out.scheduled if x.start == 0]
    return order


def test_priority_queue_orders_by_priority_then_arrival() -> None:
    q = PriorityQueue()
    reqs = [preq(f"r{i}", p) for i, p in enumerate([2, 0, 2, -1, 0])]
    for i, r in enumerate(reqs):
        r.arrival_order = i
        q.append(r)
    assert [r.request_id for r in q] == ["r3", "r1", "r4", "r0", "r2"]
    assert q[0].request_id == "r3" and len(q) == 5 and reqs[2] in q
    q.remove(reqs[1])
    assert reqs[1] not in q
    with pytest.raises(ValueError):
        q.remove(reqs[1])
    with pytest.raises(IndexError):
        q[1]
    assert [q.popleft().request_id for _ in range(4)] == ["r3", "r4", "r0", "r2"]
    assert not q
    assert isinstance(make_queue("fcfs"), FCFSQueue)
    with pytest.raises(SpecError, match="scheduling_policy"):
        make_queue("lifo")


def test_admission_is_by_priority_then_fcfs() -> None:
    # one sequence at a time: the admission order is the service order
    s = make(max_num_seqs=1, policy="priority")
    for rid, p in [("low-a", 5), ("high-a", 0), ("low-b", 5), ("mid", 2), ("high-b", 0)]:
        s.add_request(preq(rid, p))
    assert admission_order(s) == ["high-a", "high-b", "mid", "low-a", "low-b"]


def test_fcfs_ignores_priority_field_order() -> None:
    s = make(max_num_seqs=1)
    for rid in ["a", "b", "c"]:
        s.add_request(preq(rid, 0))
    assert admission_order(s) == ["a", "b", "c"]


def test_preemption_victim_is_lowest_priority_then_newest() -> None:
    # 5 usable blocks of 16 tokens; each request grows past one block and needs two.
    # Admission order: low (prio 9), urgent (0), mid (5): under FCFS the victim would
    # be the newest (mid); under priority it is the lowest priority (low), although
    # low is the oldest.
    def scenario(policy: str) -> list[str]:
        s = make(num_blocks=6, max_num_seqs=3, policy=policy)
        for rid, p in [("low", 9), ("urgent", 0), ("mid", 5)]:
            s.add_request(preq(rid, p if policy == "priority" else 0, prompt=15, max_tokens=20))
        victims: list[str] = []
        while s.has_unfinished():
            out, _ = step(s)
            victims += out.preempted
        return victims

    pv = scenario("priority")
    assert pv and pv[0] == "low", pv
    fv = scenario("fcfs")
    assert fv and fv[0] == "mid", fv


def test_preempted_request_keeps_its_place_among_its_priority() -> None:
    s = make(num_blocks=6, max_num_seqs=3, policy="priority")
    a = preq("a", 1, prompt=15, max_tokens=20)
    b = preq("b", 1, prompt=15, max_tokens=20)
    c = preq("c", 1, prompt=15, max_tokens=20)
    for r in (a, b, c):
        s.add_request(r)
    while not any(r.num_preemptions for r in (a, b, c)):
        step(s)
    assert c.num_preemptions == 1 and c in s.waiting
    late = preq("late", 1)  # same priority, arrives after c: queued behind it
    s.add_request(late)
    assert [r.request_id for r in s.waiting] == ["c", "late"]
    assert run(s) > 0
    assert s.kv.num_free_blocks == s.kv.spec.num_blocks - 1


def test_running_batch_gets_budget_in_priority_order() -> None:
    s = make(max_num_seqs=3, max_num_batched_tokens=64, policy="priority")
    s.add_request(preq("b", 3))
    step(s)  # b alone running
    s.add_request(preq("a", 1))
    step(s)  # a admitted after b
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a", "b"]


def test_engine_priority_argument_and_refusals() -> None:
    eng = LLMEngine.from_config(num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    eng.add_request("late-low", [5, 6, 7], sp, priority=10)
    eng.add_request("urgent", [5, 6, 8], sp, priority=-3)
    first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished and first is None:
                first = out.request_id
    assert first == "urgent"
    with pytest.raises(RequestRejected, match="priority: expected an int") as ei:
        eng.add_request("x", [5], sp, priority=1.5)  # type: ignore[arg-type]
    assert ei.value.reason == "invalid_request"
    fcfs = LLMEngine.from_config(num_blocks=64)
    with pytest.raises(RequestRejected, match="scheduling_policy='priority'"):
        fcfs.add_request("x", [5], sp, priority=1)
    assert not fcfs.has_unfinished_requests()
    fcfs.add_request("y", [5], sp, priority=0)  # 0 is the no-op value vLLM accepts too
    with pytest.raises(SpecError, match="scheduling_policy: expected"):
        LLMEngine.from_config(num_blocks=64, scheduling_policy="round-robin")


def test_llm_generate_priority_list() -> None:
    llm = LLM(num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    outs = llm.generate([[5, 6], [7, 8], [9, 10]], sp, use_tqdm=False, priority=[2, 0, 1])
    assert [o.request_id for o in outs] == ["0", "1", "2"]  # results stay in prompt order
    by_finish = sorted(outs, key=lambda o: o.finish_time or 0.0)
    assert [o.request_id for o in by_finish] == ["1", "2", "0"]
    with pytest.raises(RequestRejected, match="priority: expected 2 entries"):
        llm.generate([[5], [6]], sp, use_tqdm=False, priority=[0])
