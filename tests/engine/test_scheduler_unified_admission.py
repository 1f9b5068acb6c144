"""The scheduler's budget on a unified pool with sliding-window groups
(``KVCacheManager.has_transient_blocks``): a prefill chunk of ``c`` tokens holds
``c / block_size`` blocks per sliding group until its next allocation releases them, so
admitting on the first chunk's blocks alone lets a newcomer's later chunks exhaust the
pool and the running sequences preempt it by recompute, again and again (issue 25,
docs/benchmarks.md: Gemma-3-27B, 610 preemptions). With the admission reserve and cut
chunks the same requests run with no preemption, at a concurrency near the settled
bound, and every block is free at the end; per-group pools and one-group models are
scheduled as before."""

from __future__ import annotations

import pytest

from kvpage.cache import KVCacheManager
from kvpage.engine import Request, SamplingParams, Scheduler
from kvpage.specs import CacheSpec, make_cache_spec

BS = 4
WINDOW = 8
PROMPT = 96
OUT = 12
STEP = 48  # max_num_batched_tokens: a chunk of 12 blocks per group


def spec(num_blocks: int, pool: str = "unified", windows: tuple[int | None, ...] = (None, WINDOW, WINDOW)) -> CacheSpec:  # fmt: skip
    layers = [dict(num_q_heads=2, num_kv_heads=1, head_dim=8, sliding_window=w) for w in windows]
    s = make_cache_spec(num_layers=len(layers), block_size=BS, dtype="float32", layers=layers)
    return s.model_copy(update={"kv_pool": pool}).with_blocks(num_blocks)


def settled(n: int) -> int:
    """Blocks of one sequence of ``n`` computed tokens once its window is released (1
    full group + 2 sliding groups of one layer each)."""
    nb = -(-n // BS)
    return nb + 2 * (nb - max(0, n - WINDOW + 1) // BS)


def request(i: int, prompt: int = PROMPT) -> Request:
    ids = [1000 * (i + 1) + k for k in range(prompt)]  # distinct prompts: no prefix hits
    return Request(
        request_id=str(i),
        parent_id=str(i),
        sample_index=0,
        token_ids=ids,
        num_prompt_tokens=prompt,
        params=SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True),
        max_tokens=OUT,
    )


def drive(s: Scheduler, n: int) -> tuple[int, int]:
    """Run ``n`` requests to completion with fake tokens; returns (steps, peak running)."""
    for i in range(n):
        s.add_request(request(i))
    steps = peak = 0
    while s.has_unfinished():
        out = s.schedule()
        peak = max(peak, len(s.running))
        sampled = {x.request_id: [7] for x in out.scheduled if x.samples}
        s.update(out, sampled)
        s.kv.check_integrity()
        steps += 1
        assert steps < 5000, "no progress"
    return steps, peak


def test_unified_pool_with_windows_admits_without_preempting() -> None:
    per_seq = settled(PROMPT + OUT - 1)
    nb = 1 + 3 * per_seq + per_seq // 2  # 3.5 settled sequences; a chunk needs 36 blocks
    kv = KVCacheManager(spec(nb), enable_prefix_caching=False, max_alloc_tokens=STEP)
    assert kv.has_transient_blocks
    s = Scheduler(kv, max_num_batched_tokens=STEP, max_model_len=512)
    steps, peak = drive(s, 8)
    # the old admission (first chunk only) preempted running prefills here 15 times
    assert s.num_preemptions == 0
    assert peak == 3  # the settled bound: 3 sequences of 107 tokens fit, 4 do not
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == nb - 1 and kv.num_requests == 0


def test_chunks_are_cut_to_keep_the_older_sequences_next_blocks() -> None:
    """Every step leaves the sequences' next blocks free: no running decode ever finds
    the pool empty, and a prefill chunk is cut (not the sequence preempted) instead."""
    per_seq = settled(PROMPT + OUT - 1)
    nb = 1 + 2 * per_seq + 20
    kv = KVCacheManager(spec(nb), enable_prefix_caching=False, max_alloc_tokens=STEP)
    s = Scheduler(kv, max_num_batched_tokens=STEP, max_model_len=512)
    for i in range(4):
        s.add_request(request(i))
    cut = 0
    while s.has_unfinished():
        out = s.schedule()
        assert not out.preempted
        for x in out.scheduled:
            left = x.request.num_tokens - x.start
            cut += x.num_tokens < min(left, STEP) and not x.samples
        s.update(out, {x.request_id: [7] for x in out.scheduled if x.samples})
    assert cut > 0  # some chunk was cut to what fits
    assert kv.num_used_blocks == 0


@pytest.mark.parametrize("pool", ["per_group", "one_group", "unified"])
def test_monotone_pools_admit_on_the_first_chunk(pool: str) -> None:
    """Per-group pools and one-group models hold no transient blocks: the scheduler
    admits a 148-token prompt on its first chunk's blocks (12 per group) as before,
    although the whole prompt (37 blocks per group) does not fit beside the running
    sequence (25 of 40 per group); the unified pool with a sliding group (56 blocks, the
    running sequence settled in 28) waits for room for the whole prompt (40 blocks)."""
    windows: tuple[int | None, ...] = (None,) if pool == "one_group" else (None, WINDOW)
    nb = 1 + (56 if pool == "unified" else 40)
    kv = KVCacheManager(
        spec(nb, "per_group" if pool == "per_group" else "unified", windows),
        enable_prefix_caching=False,
        max_alloc_tokens=STEP,
    )
    assert kv.has_transient_blocks == (pool == "unified")
    s = Scheduler(kv, max_num_batched_tokens=STEP, max_model_len=512)
    s.add_request(request(0))
    s.update(s.schedule(), {})
    s.update(s.schedule(), {"0": [7]})  # request 0's prompt computed (2 chunks of 48)
    s.add_request(request(1, 148))
    out = s.schedule()
    assert [x.request_id for x in out.scheduled] == (["0"] if pool == "unified" else ["0", "1"])
