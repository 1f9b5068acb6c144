"""Swap preemption per KV group on the unified pool of a sliding-window hybrid (a tiny
random Gemma-2-style model: 1 full + 2 sliding groups, window 8 shorter than the
prompts), and the layouts still refused by name: KV tiers and swap on per-group pools.

Swap copies per group only the blocks a continuation needs
(``KVCacheManager.swap_blocks``: the full group all, a sliding group its window's) and
readmits with null sliding-group entries below the window (``allocate_swapped``), so no
block is ever registered in the prefix cache with content it does not hold: checked
against a run without preemption, block by block, and by a rerun served from the cache.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from engine_harness import HF_PROMPTS, NUM_NEW, hf_greedy, make_hf_model  # noqa: E402

from kvpage.engine import LLM, SamplingParams  # noqa: E402
from kvpage.errors import SpecError  # noqa: E402

GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
BS = 4
#: the mixed prompts plus two longer than 4 windows
PROMPTS = HF_PROMPTS + [
    [1] + [(5 * i + 7) % 120 + 3 for i in range(41)],
    [1] + [(11 * i + 2) % 120 + 3 for i in range(35)],
]


def _run(
    eng: Any, prompts: list[list[int]], tag: str, params: SamplingParams = GREEDY
) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs of ``prompts`` (request ids ``tag + index``) and the prompt
    indices in finishing order, the manager's integrity checked after every step."""
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", p, params)
    outs: dict[str, list[int]] = {}
    order = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
                order.append(int(o.request_id[len(tag) :]))
        eng.kv_cache_manager.check_integrity()
    return [outs[f"{tag}{i}"] for i in range(len(prompts))], order


def _cached_blocks(eng: Any) -> dict[tuple[int, bytes], torch.Tensor]:
    """(group, block hash) -> the K/V its cached block holds, over the group's layers."""
    kvm = eng.kv_cache_manager
    caches = eng.runner.kv_caches
    out = {}
    for g, (pool, grp) in enumerate(zip(kvm.pools, eng.cache_spec.kv_groups)):
        for h in pool.cached_hashes():
            bid = pool.cached_block_id(h)
            out[(g, h)] = torch.stack([caches[i].kv[:, bid] for i in grp.layer_ids]).clone()
    return out


def test_swap_per_group_on_a_unified_pool_with_sliding_windows() -> None:
    hf = make_hf_model("gemma2")
    refs = [hf_greedy(hf, p) for p in PROMPTS]
    # the same chunking without preemption: every block's content as computed
    ref_eng = LLM(hf, block_size=BS, num_blocks=400, max_num_batched_tokens=16).llm_engine
    assert _run(ref_eng, PROMPTS, "r")[0] == refs
    assert ref_eng.scheduler.num_preemptions == 0
    truth = _cached_blocks(ref_eng)

    nb = 45
    llm = LLM(hf, block_size=BS, num_blocks=nb, preemption_mode="swap", max_num_batched_tokens=16)
    eng = llm.llm_engine
    kvm = eng.kv_cache_manager
    assert kvm.unified and kvm.windows == [None, 8, 8]
    sw = eng.scheduler.swapper
    assert sw is not None and len(sw.movers) == 3
    per_swap: list[list[int]] = []  # blocks copied out per group, per swap-out
    swapped: set[str] = set()
    swap_out = sw.swap_out

    def recording_swap_out(rid: str, blocks: Any, n: int, **kw: Any) -> bool:
        done = swap_out(rid, blocks, n, **kw)
        if done:
            swapped.add(rid)
            per_swap.append([len(b) for b in blocks])
            nbk = -(-n // BS)
            assert len(blocks[0]) == nbk  # the full group: every block
            for b in blocks[1:]:  # a sliding group: the window of position n only
                assert len(b) == nbk - max(0, n - 8 + 1) // BS
        return done

    sw.swap_out = recording_swap_out  # type: ignore[method-assign]
    got, order = _run(eng, PROMPTS, "s")
    assert got == refs
    assert sw.stats.swap_outs > 0 and sw.stats.swap_ins == sw.stats.swap_outs
    assert sw.stats.recomputed == 0 and len(per_swap) == sw.stats.swap_outs
    # some victim was past its window: its sliding groups moved fewer blocks
    assert any(c[1] < c[0] for c in per_swap)
    blk = sw.movers[0].block_nbytes
    assert all(m.block_nbytes == blk for m in sw.movers)
    assert sw.stats.bytes_out == sum(map(sum, per_swap)) * blk == sw.stats.bytes_in
    assert sw.used_bytes == 0
    assert llm.get_metrics()["kvpage:swap_space_usage_bytes"] == 0
    assert kvm.num_used_blocks == 0 and kvm.num_requests == 0
    assert kvm.num_free_blocks == nb - 1
    # every cached block holds what its hash says (no stale swapped-in block registered)
    cached = _cached_blocks(eng)
    assert cached
    for key, kv in cached.items():
        assert key in truth
        torch.testing.assert_close(kv, truth[key], atol=1e-4, rtol=1e-4)
    # the last sequence to finish (swapped out and back in) continued from its cached
    # blocks (all full-group blocks, the sliding groups' window): same output as HF
    last = order[-1]
    assert f"s{last}" in swapped
    seq = PROMPTS[last] + refs[last][:-1]  # its computed tokens
    hits0 = kvm.stats.prefix_hits_tokens
    more = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert _run(eng, [seq], "again", more)[0] == [hf_greedy(hf, seq, 8)]
    assert kvm.stats.prefix_hits_tokens - hits0 == (len(seq) - 1) // BS * BS
    assert kvm.num_used_blocks == 0 and sw.used_bytes == 0
    kvm.check_integrity()


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        (dict(kv_host_tier_bytes=1 << 20, kv_pool="per_group"), "kv tiers"),
        (dict(preemption_mode="swap", kv_pool="per_group"), "preemption_mode"),
    ],
)
def test_layouts_not_built_are_refused(kw: dict, name: str) -> None:
    """KV tiers and swap on per-group pools are not built (tests/engine/
    test_engine_unified_tiers.py runs tiers on the unified pool)."""
    hf = make_hf_model("gemma2")
    with pytest.raises(SpecError, match=name):
        LLM(hf, block_size=BS, num_blocks=64, **kw)
