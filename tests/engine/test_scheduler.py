"""The model-free scheduler on the real KVCacheManager, driven with fake tokens."""

from __future__ import annotations

import contextlib
import random

import pytest

from kvpage.cache import KVCacheManager
from kvpage.engine import Request, SamplingParams, Scheduler, SchedulerOutput
from kvpage.errors import RequestRejected, SpecError
from kvpage.specs import load_preset

FAKE = 7  # the token every fake step "samples"


def make(num_blocks: int = 64, block_size: int = 16, **kw: int) -> Scheduler:
    spec = load_preset("stories260K").cache_spec(block_size=block_size, num_blocks=num_blocks)
    kv = KVCacheManager(spec, enable_prefix_caching=bool(kw.pop("prefix", 1)))
    return Scheduler(kv, **kw)


def req(rid: str, prompt: list[int] | int, max_tokens: int = 8, n: int = 1) -> Request:
    ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Request(
        request_id=rid,
        parent_id=rid,
        sample_index=0,
        token_ids=ids,
        num_prompt_tokens=len(ids),
        params=SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n),
        max_tokens=max_tokens,
        num_pending_samples=n - 1,
    )


def step(s: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    if s.waiting and not s.running:  # C08: never idle with room for the queue head
        need = s.kv.blocks_needed(s.waiting[0].num_tokens)
        assert need > s.kv.num_free_blocks, "idle step with room for the queue head"
    sampled = {x.request_id: [FAKE] * x.num_samples for x in out.scheduled if x.samples}
    _, finished = s.update(out, sampled)
    s.kv.check_integrity()
    return out, finished


def run(s: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while s.has_unfinished():
        step(s)
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def test_token_budget_chunks_prefill_then_decodes() -> None:
    s = make(max_num_batched_tokens=7)
    s.add_request(req("a", 20, max_tokens=3))
    plan = []
    while s.has_unfinished():
        out, _ = step(s)
        plan.append([(x.start, x.num_tokens, x.samples) for x in out.scheduled])
    assert plan == [
        [(0, 7, False)],
        [(7, 7, False)],
        [(14, 6, True)],
        [(20, 1, True)],
        [(21, 1, True)],
    ]


def test_decode_and_prefill_share_a_step_and_join_leave_timing() -> None:
    s = make(max_num_batched_tokens=10)
    s.add_request(req("a", 4, max_tokens=3))
    out, _ = step(s)
    assert [x.request_id for x in out.scheduled] == ["a"]
    s.add_request(req("b", 30, max_tokens=2))  # arrives while a runs: joins next step
    out, _ = step(s)
    assert [(x.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    out, fin = step(s)  # a samples its 3rd token and leaves in this step
    assert [r.request_id for r in fin] == ["a"] and s.requests["a"].finish_reason == "length"
    assert [r.request_id for r in s.running] == ["b"]
    assert not s.kv.has_request("a")


def test_c07_resumed_chunked_prefill_uses_absolute_positions() -> None:
    s = make(block_size=16, max_num_batched_tokens=8)
    base = list(range(1, 51))
    s.add_request(req("warm", base[:40], max_tokens=1))
    run(s)
    s.add_request(req("r", base, max_tokens=1))
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.start, x.num_tokens) == (32, 8) and x.request.num_cached_tokens == 32
    seen = []
    while True:
        seen += [
            (p, slot)
            for p, slot in zip(range(x.start, x.start + x.num_tokens), x.slot_mapping(0, 16))
        ]
        s.update(out, {x.request_id: [FAKE]} if x.samples else {})
        if x.samples:
            break
        out = s.schedule()
        (x,) = out.scheduled
    assert [p for p, _ in seen] == list(range(32, 50))
    bt = x.block_tables[0]
    want = [bt[2] * 16 + o for o in range(16)] + [bt[3] * 16 + o for o in range(2)]
    assert [slot for _, slot in seen] == want


def test_c08_capacity_formula_boundary_and_no_state_change() -> None:
    s = make(num_blocks=8, block_size=16, max_model_len=256)
    cap = s.kv.max_request_tokens  # 7 usable blocks * 16
    free = s.kv.num_free_blocks
    with pytest.raises(RequestRejected) as e:
        s.add_request(req("big", 200))
    assert e.value.reason == "exceeds_kv_capacity" and str(cap) in str(e.value)
    with pytest.raises(RequestRejected):
        s.add_request(req("one-more", cap - 9, max_tokens=10 + 1))  # P + M - 1 = cap + 1
    assert not s.has_unfinished() and s.kv.num_free_blocks == free and not s.samples
    s.add_request(req("largest", cap - 9, max_tokens=10))  # P + M - 1 = cap: admitted
    s.add_request(req("small", 20, max_tokens=4))
    run(s)
    assert s.requests["largest"].num_output_tokens == 10
    assert s.kv.num_free_blocks == free


def test_input_rejections() -> None:
    s = make(max_model_len=64, max_num_seqs=4)
    for r, reason in [
        (req("e", []), "empty_prompt"),
        (req("long", 64), "prompt_too_long"),
        (req("n", 4, n=5), "invalid_sampling_params"),
    ]:
        with pytest.raises(RequestRejected) as e:
            s.add_request(r)
        assert e.value.reason == reason and e.value.request_id == r.parent_id
    s.add_request(req("ok", 4))
    with pytest.raises(RequestRejected) as e:
        s.add_request(req("ok", 4))
    assert e.value.reason == "duplicate_request_id"


def test_preemption_is_newest_first_and_everyone_finishes() -> None:
    s = make(num_blocks=9, block_size=4, max_num_batched_tokens=64)  # 32 slots
    for i in range(3):
        s.add_request(req(f"r{i}", 8, max_tokens=16))
    preempted: list[str] = []
    order: list[str] = []
    while s.has_unfinished():
        out, fin = step(s)
        preempted += out.preempted
        order += [r.request_id for r in fin]
    assert preempted and "r0" not in preempted
    assert preempted[0] == "r2"
    assert order[0] == "r0"
    assert s.num_preemptions == len(preempted)
    assert all(s.requests[f"r{i}"].num_output_tokens == 16 for i in range(3))


def test_abort_frees_blocks_at_once() -> None:
    s = make()
    free = s.kv.num_free_blocks
    s.add_request(req("a", 40, max_tokens=50))
    step(s)
    assert s.kv.num_free_blocks < free
    s.abort("a")
    assert s.kv.num_free_blocks == free and not s.has_unfinished()
    assert s.requests["a"].finish_reason == "abort" and s.samples_finished("a")


def test_c06_fork_shares_prompt_blocks_and_copies_tail_once() -> None:
    s = make(block_size=16)
    s.add_request(req("p", 20, max_tokens=4, n=2))
    out, _ = step(s)  # prefill; fork after sampling
    assert [r.request_id for r in s.running] == ["p", "p#1"]
    assert s.kv.block_table("p") == s.kv.block_table("p#1")
    out, _ = step(s)
    copies = out.copies[0]
    assert len(copies) == 1
    assert s.kv.block_table("p")[0] == s.kv.block_table("p#1")[0]
    assert s.kv.block_table("p")[1] != s.kv.block_table("p#1")[1]
    run(s)
    assert s.kv.usage == 0.0


def test_random_workloads_never_deadlock_or_idle() -> None:
    rng = random.Random(0)
    for trial in range(30):
        bs = rng.choice([1, 2, 4, 16])
        nb = rng.randint(4, 40)
        s = make(
            num_blocks=nb,
            block_size=bs,
            max_num_batched_tokens=rng.choice([1, 3, 16, 256]),
            max_num_seqs=rng.choice([1, 2, 8]),
            max_model_len=128,
            prefix=rng.randint(0, 1),
        )
        cap = s.kv.max_request_tokens
        arrivals = []
        for i in range(rng.randint(1, 8)):
            p = rng.randint(1, min(40, cap))
            m = rng.randint(1, max(1, min(20, cap - p + 1)))
            shared = [5] * rng.randint(0, p)
            prompt = shared + [rng.randint(0, 511) for _ in range(p - len(shared))]
            arrivals.append(
                (rng.randint(0, 20), req(f"t{trial}-{i}", prompt, m, rng.randint(1, 2)))
            )
        t = 0
        while arrivals or s.has_unfinished():
            for a in [a for a in arrivals if a[0] <= t]:
                arrivals.remove(a)
                with contextlib.suppress(RequestRejected):
                    s.add_request(a[1])
            step(s)
            t += 1
            assert t < 20_000
        assert s.kv.usage == 0.0


def test_update_refuses_a_wrong_number_of_samples_and_appends_nothing() -> None:
    s = make()
    s.add_request(req("a", 5, n=2))  # sample 0 and one pending sample: 2 tokens a step
    out = s.schedule()
    a = out.scheduled[0].request
    with pytest.raises(SpecError, match=r"^sampled\['a'\]: expected 2 tokens, got 1$"):
        s.update(out, {"a": [FAKE]})
    assert len(a.token_ids) == 5 and a.num_pending_samples == 1  # no token, no fork
    progressed, finished = s.update(out, {"a": [FAKE, 11]})
    assert [r.token_ids[-1] for r in progressed] == [FAKE, 11] and not finished


def test_update_finishes_a_dead_end_sample_without_a_token() -> None:
    s = make()
    s.add_request(req("a", 5))
    out = s.schedule()
    progressed, finished = s.update(out, {"a": [-1]})  # DEAD_END_TOKEN
    assert progressed == finished == [out.scheduled[0].request]
    assert progressed[0].num_new_tokens == 0 and len(progressed[0].token_ids) == 5
