"""The unified block pool on the CPU engine (``CacheSpec.kv_pool``, docs/architecture.md
"One pool for every kind of layer"): a tiny random-weight Gemma-2-style model (window 8,
shorter than the prompts) in a memory budget that per-group pools cannot hold the batch
in runs it with no preemption, greedy-equal to transformers, every block free at the
end, and the pool's occupancy at every decode step equal to the planner's count."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from engine_harness import HF_PROMPTS, NUM_NEW, hf_greedy, make_hf_model  # noqa: E402

from kvpage.capacity import blocks_per_sequence  # noqa: E402
from kvpage.engine import LLM, SamplingParams  # noqa: E402
from kvpage.specs import CacheSpec  # noqa: E402

GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
BS = 4
PER_GROUP_BLOCKS = 50  # the budget, in blocks of per-group pools


def test_unified_pool_runs_what_per_group_pools_cannot_hold() -> None:
    hf = make_hf_model("gemma2")
    uni = CacheSpec.from_hf_config(hf.config, block_size=BS)
    per = CacheSpec.from_hf_config(hf.config, block_size=BS, kv_pool="per_group")
    assert [g.sliding_window for g in uni.kv_groups] == [None, 8, 8]  # 3 groups of 1 layer
    # the same bytes: 50 blocks of all 3 layers == 148 + 2 blocks of one layer each
    nb = (PER_GROUP_BLOCKS - 1) * len(uni.kv_groups) + 1
    assert (nb - 1) * uni.bytes_per_block == (PER_GROUP_BLOCKS - 1) * per.bytes_per_block
    final = [len(p) + NUM_NEW - 1 for p in HF_PROMPTS]
    # per-group pools: the full group alone needs more than the budget for the batch
    per_need = sum(int(blocks_per_sequence(per, n)) for n in final)
    assert per_need > PER_GROUP_BLOCKS - 1
    uni_need = sum(int(blocks_per_sequence(uni, n)) for n in final)
    assert uni_need <= nb - 1 < per_need * len(uni.kv_groups)

    refs = [hf_greedy(hf, p) for p in HF_PROMPTS]
    llm = LLM(hf, block_size=BS, num_blocks=nb)
    eng = llm.llm_engine
    kvm = eng.kv_cache_manager
    assert kvm.unified and kvm.num_groups == 3
    for i, p in enumerate(HF_PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    outs: dict[str, list[int]] = {}
    checked = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
        kvm.check_integrity()
        live = [str(i) for i in range(len(HF_PROMPTS)) if kvm.has_request(str(i))]
        lens = [kvm.num_allocated_tokens(r) for r in live]
        # all in decode (past their prompts): measured occupancy == the planner's figure
        if live and all(n > len(HF_PROMPTS[int(r)]) for r, n in zip(live, lens)):
            assert kvm.num_used_blocks == sum(int(blocks_per_sequence(uni, n)) for n in lens)
            checked += 1
    assert checked > 0
    assert [outs[str(i)] for i in range(len(HF_PROMPTS))] == refs
    m = llm.get_metrics()
    assert m["kvpage:num_preemptions_total"] == 0
    assert kvm.num_used_blocks == 0 and kvm.num_requests == 0
    assert kvm.num_free_blocks == nb - 1
    kvm.check_integrity()


def test_unified_pool_admits_a_sequence_per_group_pools_reject() -> None:
    """A 150-token prompt + 64 new tokens in the bytes of 30 per-group blocks: per-group
    pools hold at most 29 x 4 = 116 tokens per sequence (the request is rejected there);
    the unified pool with an 8-token step budget holds only the window (+ one step)
    in its sliding groups, so the sequence runs, greedy-equal to transformers."""
    from kvpage.cache import KVCacheManager

    hf = make_hf_model("gemma2")
    per = CacheSpec.from_hf_config(hf.config, block_size=BS, kv_pool="per_group")
    uni = CacheSpec.from_hf_config(hf.config, block_size=BS)
    nb = 29 * len(uni.kv_groups) + 1  # the bytes of 30 per-group blocks
    prompt = [1] + [(7 * i + 3) % 120 + 3 for i in range(149)]
    need = len(prompt) + NUM_NEW - 1
    assert KVCacheManager(per.with_blocks(30)).max_request_tokens < need
    assert KVCacheManager(uni.with_blocks(nb), max_alloc_tokens=8).max_request_tokens >= need
    ref = hf_greedy(hf, prompt)
    llm = LLM(hf, block_size=BS, num_blocks=nb, max_num_batched_tokens=8)
    out = llm.generate([prompt], GREEDY)
    assert list(out[0].outputs[0].token_ids) == ref
    kvm = llm.llm_engine.kv_cache_manager
    assert kvm.num_used_blocks == 0 and kvm.num_free_blocks == nb - 1
    kvm.check_integrity()
