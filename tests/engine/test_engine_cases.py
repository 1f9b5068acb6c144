"""Edge cases C03-C09 (``shared/cases/README.md``) and input handling at engine level."""

from __future__ import annotations

import pytest

from kvpage.engine import LLM, METRIC_NAMES, LLMEngine, SamplingParams
from kvpage.engine.engine import CACHE_MISS_KEYS
from kvpage.errors import RequestRejected


@pytest.fixture(scope="module")
def prompts40() -> list[list[int]]:
    return [[1] + [10 + 7 * k + i for i in range(39)] for k in range(5)]


def test_c03_usage_returns_to_zero_and_full_request_evicts(prompts40: list[list[int]]) -> None:
    llm = LLM("stories260K", block_size=16, num_blocks=8)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for r in range(20):
        (out,) = llm.generate([prompts40[r % 5]], params)
        assert len(out.outputs[0].token_ids) == 8
        m = llm.get_metrics()
        assert m["kvpage:num_requests_running"] == 0
        assert m["kvpage:kv_cache_usage_perc"] == 0.0
        assert 0.0 <= eng.kv_cache_manager.usage <= 1.0
    cap = eng.kv_cache_manager.max_request_tokens  # all 7 usable blocks
    (big,) = llm.generate(
        [list(range(1, cap - 12))], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    )
    assert big.error is None and len(big.outputs[0].token_ids) == 14
    assert llm.get_metrics()["kvpage:evictions_total"] > 0
    eng.kv_cache_manager.check_integrity()


def test_c04_same_step_no_hit_then_exact_hit_and_abort_never_cached(
    prompts40: list[list[int]],
) -> None:
    llm = LLM("stories260K", block_size=16, num_blocks=32)
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    a, b = llm.generate([prompts40[0], prompts40[0]], p)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    (c,) = llm.generate([prompts40[0]], p)
    assert c.num_cached_tokens == 32
    eng = llm.llm_engine
    eng.add_request("x", prompts40[1], p)
    eng.scheduler.schedule()  # blocks allocated, step never runs
    eng.abort_request("x")
    assert eng.kv_cache_manager.get_num_cached_tokens(prompts40[1]) == 0
    assert llm.get_metrics()["kvpage:kv_cache_usage_perc"] == 0.0


def test_c05_fully_cached_prompt_still_computes_one_token() -> None:
    llm = LLM("stories260K", block_size=16, num_blocks=32)
    prompt = [1] + list(range(40, 71))  # 32 tokens
    p = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = [llm.generate([prompt], p)[0] for _ in range(3)]
    assert [r.num_cached_tokens for r in runs] == [0, 16, 16]
    assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids
    assert runs[1].outputs[0].token_ids == runs[2].outputs[0].token_ids
    (r33,) = llm.generate([prompt + [99]], p)
    assert r33.num_cached_tokens == 32


def test_c06_parallel_samples_match_solo_runs_and_copy_once() -> None:
    prompt = [1] + list(range(50, 69))  # 20 tokens: 1 full block + 4-token tail
    llm = LLM("stories260K", block_size=16, num_blocks=32, enable_prefix_caching=False)
    kv = llm.llm_engine.kv_cache_manager
    two = SamplingParams(max_tokens=24, temperature=1.0, seed=11, n=2, ignore_eos=True)
    (out,) = llm.generate([prompt], two)
    assert kv.stats.cow_copies == 1
    branches = [o.token_ids for o in out.outputs]
    assert branches[0] != branches[1]
    for i in range(2):
        solo = SamplingParams(max_tokens=24, temperature=1.0, seed=11 + i, ignore_eos=True)
        assert llm.generate([prompt], solo)[0].outputs[0].token_ids == branches[i]
    assert kv.usage == 0.0
    kv.check_integrity()


def test_c07_resumed_chunked_prefill_equals_one_shot() -> None:
    base = [1] + [(7 * i) % 500 + 3 for i in range(49)]  # 50 tokens
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = LLM("stories260K", enable_prefix_caching=False, num_blocks=32).generate([base], p)[0]
    llm = LLM("stories260K", block_size=16, num_blocks=32, max_num_batched_tokens=8)
    llm.generate([base[:40]], SamplingParams(temperature=0.0, max_tokens=1))  # caches blocks 0-1
    (out,) = llm.generate([base], p)
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_c08_request_bigger_than_pool_does_not_block_queue() -> None:
    llm = LLM("stories260K", block_size=16, num_blocks=8, max_model_len=256)
    eng = llm.llm_engine
    free = eng.kv_cache_manager.num_free_blocks
    r1, r2 = llm.generate(
        [list(range(1, 201)), list(range(1, 21))], SamplingParams(temperature=0.0, max_tokens=8)
    )
    assert r1.error is not None and r1.error.reason == "exceeds_kv_capacity"
    assert "112" in str(r1.error)
    assert r2.error is None and r2.outputs[0].finish_reason in ("stop", "length")
    cap = eng.kv_cache_manager.max_request_tokens
    ok = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (largest,) = llm.generate([list(range(1, cap - 10))], ok)  # P + M - 1 == cap
    assert largest.error is None and len(largest.outputs[0].token_ids) == 12
    with pytest.raises(RequestRejected) as e:
        eng.add_request("one-more", list(range(1, cap - 9)), ok)
    assert e.value.reason == "exceeds_kv_capacity"
    assert eng.kv_cache_manager.num_free_blocks == free
    assert not eng.has_unfinished_requests()


def test_c09_empty_prompt_rejected_others_complete() -> None:
    llm = LLM("stories260K", block_size=16, num_blocks=32)
    free = llm.llm_engine.kv_cache_manager.num_free_blocks
    empty, ok = llm.generate(
        [[], list(range(1, 11))], SamplingParams(temperature=0.0, max_tokens=5)
    )
    assert empty.error is not None and empty.error.reason == "empty_prompt"
    assert "got 0" in str(empty.error) and empty.outputs == []
    assert ok.error is None and len(ok.outputs[0].token_ids) >= 1
    assert llm.llm_engine.kv_cache_manager.num_free_blocks == free
    assert llm.get_metrics()["kvpage:requests_rejected_total"] == 1
    (e2,) = llm.generate([""], SamplingParams(temperature=0.0, max_tokens=5))
    assert e2.error is not None and e2.error.reason == "empty_prompt"


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_invalid_sampling_params(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(RequestRejected) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.reason == "invalid_sampling_params"
    assert str(e.value).startswith(f"{name}: expected ") and ", got " in str(e.value)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine.from_config(block_size=16, num_blocks=64, max_model_len=128)


def test_rejections_leave_engine_unchanged(engine: LLMEngine) -> None:
    free = engine.kv_cache_manager.num_free_blocks
    bad = [
        (list(range(1, 129)), SamplingParams(), "prompt_too_long"),
        ([1, 600], SamplingParams(), "invalid_prompt"),
        ({"foo": 1}, SamplingParams(), "invalid_prompt"),
        ([1, 2], "greedy", "invalid_sampling_params"),
    ]
    for prompt, params, reason in bad:
        with pytest.raises(RequestRejected) as e:
            engine.add_request("bad", prompt, params)  # type: ignore[arg-type]
        assert e.value.reason == reason and e.value.request_id == "bad"
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == free
    assert engine.step() == []


def test_stop_conditions_and_text(engine: LLMEngine) -> None:
    tok = engine.tokenizer
    llm = LLM.from_engine(engine)
    (ref,) = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=40))
    toks = ref.outputs[0].token_ids
    assert ref.outputs[0].text == tok.decode(toks)
    assert ref.outputs[0].text.startswith(", there was")
    (st,) = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[toks[5]]),
    )
    assert st.outputs[0].token_ids == toks[: toks.index(toks[5]) + 1]
    assert st.outputs[0].finish_reason == "stop"
    (ss,) = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=40, stop=["little"])
    )
    assert ss.outputs[0].finish_reason == "stop" and "little" not in ss.outputs[0].text
    assert ref.outputs[0].text.startswith(ss.outputs[0].text)
    assert ref.ttft is not None and ref.e2e_latency is not None and ref.e2e_latency >= ref.ttft


def test_eos_ends_and_ignore_eos_continues(engine: LLMEngine) -> None:
    llm = LLM.from_engine(engine)
    (ref,) = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=20))
    toks = ref.outputs[0].token_ids
    real_eos = engine.eos_token_id
    engine.eos_token_id = toks[6]  # pretend this token is EOS for new requests
    try:
        (out,) = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=400))
        (more,) = llm.generate(
            ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        )
    finally:
        engine.eos_token_id = real_eos
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids == toks[: toks.index(toks[6]) + 1]
    assert more.outputs[0].finish_reason == "length"
    assert len(more.prompt_token_ids) + len(more.outputs[0].token_ids) == 128  # max_model_len


def test_seeded_sampling_is_reproducible_and_top_k1_is_greedy(engine: LLMEngine) -> None:
    llm = LLM.from_engine(engine)
    p = SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    a, b = llm.generate(["The dog", "The dog"], p)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    (c,) = llm.generate(["The dog"], SamplingParams(max_tokens=30, temperature=1.0, seed=4))
    assert c.outputs[0].token_ids != a.outputs[0].token_ids
    g, k1 = llm.generate(
        ["The dog"] * 2,
        [
            SamplingParams(max_tokens=30, temperature=0.0),
            SamplingParams(max_tokens=30, temperature=0.7, top_k=1),
        ],
    )
    assert g.outputs[0].token_ids == k1.outputs[0].token_ids


def test_abort_and_metric_names(engine: LLMEngine) -> None:
    free = engine.kv_cache_manager.num_free_blocks
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.get_metrics()["kvpage:num_requests_running"] == 1
    engine.abort_request("a")
    assert engine.kv_cache_manager.num_free_blocks == free
    assert not engine.has_unfinished_requests()
    m = engine.get_metrics()
    assert tuple(m) == METRIC_NAMES + CACHE_MISS_KEYS and all(
        isinstance(v, float) for v in m.values()
    )


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantized_kv_cache_runs_end_to_end(kv_dtype: str) -> None:
    p = SamplingParams(temperature=0.0, max_tokens=20)
    ref = LLM("stories260K", num_blocks=32).generate(["Once upon a time"], p)[0]
    llm = LLM("stories260K", num_blocks=32, kv_cache_dtype=kv_dtype)  # type: ignore[arg-type]
    (out,) = llm.generate(["Once upon a time"], p)
    assert llm.llm_engine.cache_spec.kv_dtype == kv_dtype
    # quantization error is far below this trained model's top-1 margins early on
    assert out.outputs[0].token_ids[:10] == ref.outputs[0].token_ids[:10]
    assert llm.get_metrics()["kvpage:kv_cache_usage_perc"] == 0.0
