"""Retention and cache-miss explanations through the engine (bundled stories260K): the
``kv_retention`` sampling parameter, ``RequestOutput.cache_miss`` /
``num_cached_tokens_by_tier`` for each reason an engine run can produce, and the
metrics."""

from __future__ import annotations

import random

import pytest

from kvpage.engine import LLM, SamplingParams
from kvpage.engine.engine import CACHE_MISS_METRIC
from kvpage.errors import RequestRejected, SpecError

GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
RNG = random.Random(16)
SYSTEM = [1] + [RNG.randrange(3, 500) for _ in range(63)]  # 64 tokens: 4 blocks of 16


def distinct(i: int, n: int = 60) -> list[int]:
    r = random.Random(1000 + i)
    return [1] + [r.randrange(3, 500) for _ in range(n - 1)]


def make_llm(**kw: object) -> LLM:
    return LLM("stories260K", block_size=16, num_blocks=40, max_num_seqs=4, **kw)


def test_reasons_never_seen_full_hit_and_by_tier() -> None:
    llm = make_llm()
    prompt = SYSTEM + [7, 8, 9]
    (a,) = llm.generate([prompt], SamplingParams(**GREEDY))
    assert a.cache_miss is not None and a.cache_miss.reason == "never_seen"
    assert a.num_cached_tokens_by_tier == {"device": 0}
    (b,) = llm.generate([prompt], SamplingParams(**GREEDY))
    assert b.num_cached_tokens == 64 and b.num_cached_tokens_by_tier == {"device": 64}
    assert b.cache_miss is not None and b.cache_miss.reason == "full_hit"
    assert b.cache_miss.num_missed_tokens == len(prompt) - 64
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    m = llm.get_metrics()
    assert m[f'{CACHE_MISS_METRIC}{{reason="never_seen"}}'] == 1.0
    assert m[f'{CACHE_MISS_METRIC}{{reason="full_hit"}}'] == 1.0


def test_evicted_then_pinned_prompt_survives_the_same_flood() -> None:
    flood = [distinct(i) for i in range(16)]  # 16 x 4 blocks: more than the pool
    llm = make_llm()
    llm.generate([SYSTEM + [5]], SamplingParams(**GREEDY))
    llm.generate(flood, SamplingParams(**GREEDY))
    (out,) = llm.generate([SYSTEM + [6]], SamplingParams(**GREEDY))
    why = out.cache_miss
    assert why is not None and (why.reason, why.tier, why.policy) == ("evicted", "device", "lru")
    # the same traffic, with the system prompt pinned for an hour
    llm = make_llm()
    pin = {"ranges": [{"start": 0, "end": 64, "priority": 3, "ttl_s": 3600}]}
    llm.generate([SYSTEM + [5]], SamplingParams(**GREEDY, kv_retention=pin))
    assert llm.get_metrics()["kvpage:kv_retained_blocks"] == 4.0
    llm.generate(flood, SamplingParams(**GREEDY))
    (out,) = llm.generate([SYSTEM + [6]], SamplingParams(**GREEDY))
    assert out.num_cached_tokens == 64 and out.cache_miss is not None
    assert out.cache_miss.reason == "full_hit"


def test_retention_cap_leaves_room_for_one_max_length_request() -> None:
    llm = make_llm(kv_retention_max_share=1.0)
    kvm = llm.llm_engine.kv_cache_manager
    assert kvm.max_retained_blocks == 39 - 32  # 39 usable, 512 tokens = 32 blocks
    pin = {"ranges": [{"start": 0, "priority": 3}]}
    llm.generate([distinct(i) for i in range(4)], SamplingParams(**GREEDY, kv_retention=pin))
    assert kvm.num_retained_blocks == 7
    big = distinct(99, 500)
    (out,) = llm.generate([big], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 12 and out.num_preemptions == 0
    assert kvm.num_retained_blocks == 7  # fit in the blocks retention does not hold
    with pytest.raises(SpecError, match="kv_retention_max_share"):
        make_llm(kv_retention_max_share=2)


def test_different_salt_and_prompt_logprobs_reasons() -> None:
    llm = make_llm()
    prompt = SYSTEM + [9]
    llm.generate([{"prompt_token_ids": prompt, "cache_salt": "a"}], SamplingParams(**GREEDY))
    (b,) = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "b"}], SamplingParams(**GREEDY))
    assert b.num_cached_tokens == 0
    assert b.cache_miss is not None and b.cache_miss.reason == "different_cache_key"
    assert b.cache_miss.public().reason == "never_seen"
    (c,) = llm.generate([prompt], SamplingParams(**GREEDY, prompt_logprobs=0))
    assert c.cache_miss is not None and c.cache_miss.reason == "prompt_logprobs"


def test_prefix_caching_off_reason_and_retention_refused() -> None:
    llm = make_llm(enable_prefix_caching=False)
    (a,) = llm.generate([SYSTEM], SamplingParams(**GREEDY))
    assert a.cache_miss is not None and a.cache_miss.reason == "prefix_caching_disabled"
    with pytest.raises(RequestRejected, match="kv_retention: expected no policy"):
        llm.llm_engine.add_request(
            "r", SYSTEM, SamplingParams(**GREEDY, kv_retention={"decode_priority": 0})
        )


def test_bad_kv_retention_is_refused_by_name() -> None:
    with pytest.raises(RequestRejected, match=r"kv_retention.ranges\[0\].ttl_s: expected"):
        SamplingParams(kv_retention={"ranges": [{"priority": 2, "ttl_s": "1h"}]})
    with pytest.raises(RequestRejected, match=r"kv_retention: expected an object"):
        SamplingParams(kv_retention=[1, 2])
