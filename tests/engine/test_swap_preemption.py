"""Swap preemption on the bundled model: greedy output identical to recompute mode and
to a pool without preemption; swap-outs all come back; the cost model's rule; a
swapped-out request that is aborted frees its host memory."""

from __future__ import annotations

import pytest

from kvpage.engine import LLM, LLMEngine, SamplingParams
from kvpage.engine.swap import SwapCostModel
from kvpage.errors import SpecError

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [[1 + (i * 53 + j * 7) % 500 for j in range(40)] for i in range(6)]


def outputs(**kw: object) -> tuple[list[list[int]], LLM]:
    llm = LLM("stories260K", block_size=16, max_num_seqs=8, **kw)  # type: ignore[arg-type]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.llm_engine.kv_cache_manager.check_integrity()
    return [list(o.outputs[0].token_ids) for o in outs], llm


def test_swap_same_output_as_recompute_and_no_preemption() -> None:
    base, _ = outputs(num_blocks=64)
    rec, llm_r = outputs(num_blocks=12)
    swp, llm_s = outputs(num_blocks=12, preemption_mode="swap")
    assert llm_r.llm_engine.scheduler.num_preemptions > 0
    m = llm_s.get_metrics()
    assert m["kvpage:num_preemptions_total"] > 0
    assert m["kvpage:swap_outs_total"] > 0
    assert m["kvpage:swap_ins_total"] == m["kvpage:swap_outs_total"]
    assert m["kvpage:swap_space_usage_bytes"] == 0
    assert base == rec == swp
    # swap skips the recompute: fewer prefill tokens computed than recompute mode
    assert llm_s.llm_engine.step_stats.prefill_tokens < llm_r.llm_engine.step_stats.prefill_tokens


def test_swap_space_that_holds_no_block_is_refused() -> None:
    # swap mode with no room for one block could never swap: refused by name
    for space in (0, 100):
        with pytest.raises(
            SpecError, match=r"swap_space_bytes: expected \(with swap\) at least one block"
        ):
            outputs(num_blocks=12, preemption_mode="swap", swap_space_bytes=space)


def test_cost_model_rule() -> None:
    c = SwapCostModel(host_bandwidth=1e9, prefill_tokens_per_s=1000.0)
    assert c.swap_seconds(10**9) == 2.0 and c.recompute_seconds(500) == 0.5
    assert c.prefer_swap(16, 20480) and not c.prefer_swap(16, 10**9)
    c.observe(10, 1.0)  # too small a step: ignored
    assert c.prefill_tokens_per_s == 1000.0
    c.observe(2000, 1.0)
    assert c.prefill_tokens_per_s == 1200.0


def test_abort_while_swapped_out_frees_host_memory() -> None:
    eng = LLMEngine.from_config(
        model="stories260K", block_size=16, num_blocks=12, preemption_mode="swap"
    )
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    sw = eng.scheduler.swapper
    assert sw is not None
    for _ in range(200):
        eng.step()
        swapped = [r for r in eng.scheduler.waiting if r.swapped_tokens]
        if swapped:
            break
    assert swapped and sw.used_bytes > 0
    for r in swapped:
        eng.abort_request(r.parent_id)
    assert sw.used_bytes == sum(
        len(sw._store[r.request_id][0]) * sw.movers[0].block_nbytes
        for r in eng.scheduler.waiting
        if r.swapped_tokens
    )
    while eng.has_unfinished_requests():
        eng.step()
    assert sw.used_bytes == 0
    eng.kv_cache_manager.check_integrity()


def test_swap_in_longer_than_the_step_budget() -> None:
    """A swapped sequence longer than ``max_num_batched_tokens`` comes back in one
    allocation (its swapped tokens are not computed): the budget bounds one call only
    on a unified pool (``KVCacheManager.max_alloc_tokens``)."""
    base, _ = outputs(num_blocks=64)
    swp, llm = outputs(num_blocks=12, preemption_mode="swap", max_num_batched_tokens=32)
    m = llm.get_metrics()
    assert m["kvpage:swap_ins_total"] > 0 and m["kvpage:swap_space_usage_bytes"] == 0
    assert swp == base
