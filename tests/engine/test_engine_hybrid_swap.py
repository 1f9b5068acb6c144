"""Swap preemption on hybrid models (tiny random qwen3_next and granitemoehybrid built
offline): a swapped sequence's live recurrent state goes to host memory beside its KV
blocks and comes back into a new live slot before its next forward; greedy output
equal to transformers in float32; swaps happened; every block, live state slot and
swapped byte free at the end; a swap space too small for one sequence's blocks and
state is refused, one too small for a given victim sends it to recompute."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpage.engine import LLM, LLMEngine
from kvpage.engine.params import SamplingParams
from kvpage.errors import SpecError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from hybrid_harness import hf_generate  # noqa: E402
from test_models_hybrid import make_hf  # noqa: E402

transformers = pytest.importorskip("transformers")

BS = 16
N_OUT = 30
#: prompts avoid token 0 (the pad token, masked by transformers' generate)
PROMPTS = [[3 + (i * 37 + j * 11) % 240 for j in range(34 + 5 * i)] for i in range(4)]


@pytest.fixture(scope="module", params=["qwen3_next", "granitemoehybrid"])
def model(request: Any, tmp_path_factory: Any) -> tuple[Any, str]:
    hf = make_hf(request.param, max_position_embeddings=512)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, str(folder)


def _llm(folder: str, **kw: Any) -> LLM:
    args: dict[str, Any] = dict(
        model=folder, block_size=BS, max_model_len=512, seed=0, num_blocks=12,
        max_num_seqs=4, max_num_batched_tokens=32, preemption_mode="swap",
        state_snapshot_slots=4,
    )  # fmt: skip
    args.update(kw)
    return LLM(**args)


def _generate(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _all_free(eng: LLMEngine) -> None:
    kv = eng.kv_cache_manager
    kv.check_integrity()
    assert kv.num_requests == 0 and kv.num_used_blocks == 0
    assert kv.state is not None and kv.state.num_live_used == 0
    sw = eng.scheduler.swapper
    assert sw is not None and sw.used_bytes == 0
    assert not sw._store and not sw._state_store


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_swap_equal_to_transformers(model: tuple[Any, str], prefix_caching: bool) -> None:
    hf, folder = model
    llm = _llm(folder, enable_prefix_caching=prefix_caching)
    eng = llm.llm_engine
    sw = eng.scheduler.swapper
    assert sw is not None and sw.state is not None
    state_b = eng.cache_spec.state_bytes_per_sequence
    assert sw.state_nbytes == state_b  # every state layer's conv + ssm row
    got = _generate(llm)
    m = llm.get_metrics()
    if prefix_caching:  # snapshots were taken and served beside the swaps
        assert m["kvpage:state_snapshots_taken_total"] > 0
    assert m["kvpage:swap_outs_total"] > 0
    assert m["kvpage:swap_ins_total"] == m["kvpage:swap_outs_total"]
    assert m["kvpage:swap_space_usage_bytes"] == 0
    # the state travelled with the blocks: each swap moved one state out and back in
    blk = sw.movers[0].block_nbytes
    moved = sw.stats.bytes_out + sw.stats.bytes_in
    assert (moved - 2 * sw.stats.swap_outs * state_b) % blk == 0
    assert sw.stats.bytes_out > sw.stats.swap_outs * state_b
    for p, g in zip(PROMPTS, got):
        assert g == hf_generate(hf, p, N_OUT)
    _all_free(eng)


def test_swap_skips_the_recompute(model: tuple[Any, str]) -> None:
    """The same workload in recompute mode preempts and recomputes; swap computes fewer
    prefill tokens and gives the same tokens."""
    _, folder = model
    rec_llm = _llm(folder, preemption_mode="recompute")
    rec = _generate(rec_llm)
    swp_llm = _llm(folder)
    swp = _generate(swp_llm)
    assert rec_llm.llm_engine.scheduler.num_preemptions > 0
    assert rec == swp
    assert (
        swp_llm.llm_engine.step_stats.prefill_tokens < rec_llm.llm_engine.step_stats.prefill_tokens
    )


def test_swap_out_runs_the_queued_state_copies_first(model: tuple[Any, str]) -> None:
    """A victim whose last step queued a snapshot of its live slot: the snapshot copy
    runs before the slot is read and freed, and the swapped state equals the live
    slot's content after that copy (the state after its computed tokens)."""
    _, folder = model
    eng = _llm(folder).llm_engine
    sp = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    eng.add_request("a", list(range(3, 43)), sp)  # 40 tokens: prompt boundary 32
    pool = eng.kv_cache_manager.state
    assert pool is not None and eng.runner.state_caches is not None
    eng.step()  # budget 32: the chunk ends at the prompt's boundary 32 -> snapshot queued
    assert pool.num_pending_copies == 1
    src, dst = pool.pending_copies()[0]
    live = [(c.conv[src].clone(), c.ssm[src].clone()) for c in eng.runner.state_caches]
    req = eng.scheduler.running[0]
    sw = eng.scheduler.swapper
    assert sw is not None
    eng.scheduler.running.remove(req)
    eng.scheduler.preemptor.preempt(req)
    assert req.swapped_tokens == 32 and pool.num_pending_copies == 0
    assert not pool.has_live("a")
    for c, (conv, ssm) in zip(eng.runner.state_caches, live):
        assert c.conv[dst].equal(conv) and c.ssm[dst].equal(ssm)  # the snapshot ran
    host = torch.from_numpy(sw._state_store["a"].copy())
    want = torch.cat(
        [t.contiguous().view(torch.uint8).reshape(-1) for conv, ssm in live for t in (conv, ssm)]
    )
    assert host.equal(want)
    while eng.has_unfinished_requests():
        eng.step()
    _all_free(eng)


def test_swap_space_too_small_for_blocks_and_state_is_refused(model: tuple[Any, str]) -> None:
    _, folder = model
    llm = _llm(folder)
    sw = llm.llm_engine.scheduler.swapper
    assert sw is not None
    need = sw.movers[0].block_nbytes + sw.state_nbytes
    with pytest.raises(
        SpecError,
        match=r"swap_space_bytes: expected \(with swap\) at least one block's K/V and one recurrent state",
    ):
        _llm(folder, swap_space_bytes=need - 1)
    small = _llm(folder, swap_space_bytes=need)  # holds a 1-block sequence only
    assert small.llm_engine.scheduler.swapper is not None
    got = _generate(small)
    ss = small.llm_engine.scheduler.swapper.stats
    assert small.llm_engine.scheduler.num_preemptions > 0 and ss.recomputed > 0
    assert got == _generate(_llm(folder, preemption_mode="recompute"))
    _all_free(small.llm_engine)


def test_abort_while_swapped_out_frees_the_state_bytes(model: tuple[Any, str]) -> None:
    _, folder = model
    eng = _llm(folder).llm_engine
    sp = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, sp)
    sw = eng.scheduler.swapper
    assert sw is not None
    swapped: list[Any] = []
    for _ in range(300):
        eng.step()
        swapped = [r for r in eng.scheduler.waiting if r.swapped_tokens]
        if swapped:
            break
    assert swapped and sw.used_bytes > 0
    for r in swapped:
        eng.abort_request(r.parent_id)
        assert r.request_id not in sw._state_store
    while eng.has_unfinished_requests():
        eng.step()
    _all_free(eng)


def test_n2_forks_under_swap(model: tuple[Any, str]) -> None:
    """Forked samples (the fork's live -> live copy queued) preempted by swap: every
    sample equals transformers' greedy output."""
    hf, folder = model
    llm = _llm(folder)
    sp = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True, n=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], sp, use_tqdm=False)
    assert llm.get_metrics()["kvpage:swap_outs_total"] > 0
    for p, o in zip(PROMPTS, outs):
        want = hf_generate(hf, p, N_OUT)
        assert [list(c.token_ids) for c in o.outputs] == [want, want]
    _all_free(llm.llm_engine)


def test_recurrent_only_swap_is_refused(tmp_path: Any) -> None:
    make_hf("mamba2").save_pretrained(tmp_path)
    with pytest.raises(SpecError, match="recurrent layers only"):
        _llm(str(tmp_path))


def test_swap_in_runs_the_queued_state_copies_first(model: tuple[Any, str]) -> None:
    """A finished sequence's last step queued its end-state snapshot out of live slot 0;
    a swapped-in sequence takes slot 0 in the next schedule: the snapshot copy runs
    before the swapped state is written there, so the snapshot holds the finished
    sequence's state, and both outputs equal transformers'."""
    hf, folder = model
    eng = _llm(folder, max_num_seqs=1, num_blocks=32).llm_engine
    sched, pool = eng.scheduler, eng.kv_cache_manager.state
    assert pool is not None and eng.runner.state_caches is not None and pool.num_live_slots == 1
    sp = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
    pb = PROMPTS[1]
    eng.add_request("b", pb, sp)
    eng.step()  # b's first chunk
    b = sched.running.pop()
    sched.preemptor.preempt(b)  # swapped out; live slot 0 free
    assert b.swapped_tokens > 0 and sched.waiting.popleft() is b
    pa = list(range(3, 40))  # 37 tokens + 27 computed outputs = 64: the last step's snapshot
    eng.add_request("a", pa, SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True))
    outs: dict[str, list[int]] = {}
    while "a" not in outs:
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    assert pool.num_pending_copies == 1
    src, dst = pool.pending_copies()[0]
    assert src == 0
    a_state = [(c.conv[0].clone(), c.ssm[0].clone()) for c in eng.runner.state_caches]
    sched.waiting.appendleft(b)
    eng.step()  # b readmitted into slot 0 and swapped in
    for c, (conv, ssm) in zip(eng.runner.state_caches, a_state):
        assert c.conv[dst].equal(conv) and c.ssm[dst].equal(ssm)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    assert outs["a"] == hf_generate(hf, pa, 28) and outs["b"] == hf_generate(hf, pb, N_OUT)
    _all_free(eng)
