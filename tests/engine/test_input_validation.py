"""Bad input is rejected before it touches engine state, and a failing step leaves the
engine usable (findings of the fresh-user break-it session, engine items 1, 5-9, 11)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvpage.engine import LLM, LLMEngine, SamplingParams
from kvpage.engine.config import EngineConfig
from kvpage.errors import RequestRejected, SpecError

INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("stories260K", block_size=16, num_blocks=64)


def _assert_clean(llm: LLM) -> None:
    eng = llm.llm_engine
    assert eng.get_num_unfinished_requests() == 0
    assert not eng.scheduler.has_unfinished() and not eng.scheduler.samples
    assert llm.get_metrics()["kvpage:kv_cache_usage_perc"] == 0.0
    eng.kv_cache_manager.check_integrity()


# ---- item 1 and 8: every SamplingParams integer in torch's int64 range ------------------
@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": INT64_MAX, "n": 2}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"top_k": 2**63}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"n": 2**63}, "n"),
        ({"n": 0}, "n"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"top_p": float("nan")}, "top_p"),
        ({"temperature": float("inf")}, "temperature"),
    ],
)
def test_sampling_params_rejects_out_of_range(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(RequestRejected, match=rf"^{name}: expected .*, got ") as e:
        SamplingParams(**kwargs)
    assert e.value.reason == "invalid_sampling_params"


def test_sampling_params_extremes_accepted_and_top_k_message_matches() -> None:
    SamplingParams(seed=INT64_MAX, n=1)
    SamplingParams(seed=INT64_MAX - 3, n=4)
    for k in (-1, 0, 1, INT64_MAX):
        SamplingParams(top_k=k)
    with pytest.raises(RequestRejected, match=r"-1 or 0 \(off\)"):
        SamplingParams(top_k=-2)


def test_huge_seed_rejects_only_that_request_and_engine_stays_usable(llm: LLM) -> None:
    ok = SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)
    bad = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    bad.seed = 2**64  # mutated after construction: add_request re-validates
    outs = llm.generate(["Hi", "Hello"], [ok, bad])
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
    assert outs[1].error is not None and str(outs[1].error).startswith("seed:")
    _assert_clean(llm)
    (again,) = llm.generate(["Hi"], ok)
    assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_failing_step_drops_its_requests_and_frees_blocks(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = llm.llm_engine
    calls = {"n": 0}
    real = eng.sampler.sample

    def flaky(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("sampler exploded")
        return real(*args)

    monkeypatch.setattr(eng.sampler, "sample", flaky)
    params = SamplingParams(max_tokens=6, ignore_eos=True, n=2, temperature=1.0, seed=1)
    with pytest.raises(RuntimeError, match="sampler exploded"):
        llm.generate(["Once upon a time", "Lily"], params)
    _assert_clean(llm)
    assert len(eng.failed_request_ids) >= 1
    monkeypatch.undo()
    outs = llm.generate(["Once upon a time", "Lily"], params)
    assert all(o.error is None and len(o.outputs) == 2 for o in outs)
    _assert_clean(llm)


def test_failing_step_keeps_requests_it_did_not_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = LLMEngine.from_config(block_size=16, num_blocks=64, max_num_seqs=1)
    p = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    eng.add_request("a", [1, 5, 6], p)
    eng.add_request("b", [1, 7, 8], p)  # waits: one running sequence at most
    monkeypatch.setattr(eng.runner, "execute", lambda out: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        eng.step()
    assert list(eng.failed_request_ids) == ["a"]
    assert eng.get_num_unfinished_requests() == 1
    monkeypatch.undo()
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in done] == ["b"] and len(done[0].outputs[0].token_ids) == 3
    assert eng.kv_cache_manager.usage == 0.0
    eng.kv_cache_manager.check_integrity()


# ---- item 7: strict token-id prompts ------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([1, "403"], r"prompt_token_ids\[1\]: expected int, got str"),
        ([1, 2.7], r"prompt_token_ids\[1\]: expected int, got float"),
        ([1, True], r"prompt_token_ids\[1\]: expected int, got bool"),
        ([42, "Lily"], r"prompt_token_ids\[1\]: expected int, got str"),
        ({"prompt_token_ids": [1, 9], "bogus": 1}, r"unknown \['bogus'\]"),
        ({"prompt_token_ids": "1 9"}, r"prompt_token_ids: expected a list of ints"),
        ({"prompt": [1, 9]}, r"prompt: expected a string"),
        (b"hi", r"got bytes"),
        (np.array([1.0, 2.0]), r"expected a 1-D integer array"),
        (np.array([[1, 2]]), r"expected a 1-D integer array"),
        (torch.tensor([True, False]), r"expected a 1-D integer array"),
    ],
)
def test_bad_token_prompts_rejected(llm: LLM, prompt: Any, match: str) -> None:
    eng = llm.llm_engine
    with pytest.raises(RequestRejected, match=match) as e:
        eng.add_request("bad", prompt, SamplingParams(temperature=0.0, max_tokens=2))
    assert e.value.reason == "invalid_prompt"
    if getattr(prompt, "ndim", 1) == 1:
        (out,) = llm.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=2)
        )  # one prompt, one error
        assert out.error is not None and out.error.reason == "invalid_prompt"
    _assert_clean(llm)


def test_two_dimensional_array_is_a_batch(llm: LLM) -> None:
    outs = llm.generate(np.array([[1, 5], [1, 6]]), SamplingParams(temperature=0.0, max_tokens=2))
    assert [o.prompt_token_ids for o in outs] == [[1, 5], [1, 6]]


@pytest.mark.parametrize(
    "prompt",
    [
        np.array([1, 403, 9], dtype=np.int64),
        np.array([1, 403, 9], dtype=np.uint16),
        torch.tensor([1, 403, 9]),
        [np.int64(1), 403, np.int32(9)],
        (1, 403, 9),
    ],
)
def test_integer_arrays_are_one_prompt(llm: LLM, prompt: Any) -> None:
    outs = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(outs) == 1 and outs[0].error is None
    assert outs[0].prompt_token_ids == [1, 403, 9]


@pytest.mark.parametrize("rid", [None, 7, "", b"x"])
def test_request_id_must_be_a_nonempty_string(llm: LLM, rid: Any) -> None:
    with pytest.raises(RequestRejected, match=r"^request_id: expected a non-empty string"):
        llm.llm_engine.add_request(rid, [1, 2], SamplingParams(temperature=0.0, max_tokens=2))
    _assert_clean(llm)


@pytest.mark.parametrize("at", [float("nan"), float("inf"), "now", True])
def test_arrival_time_must_be_finite(llm: LLM, at: Any) -> None:
    with pytest.raises(RequestRejected, match=r"^arrival_time: expected None or a finite"):
        llm.llm_engine.add_request("t", [1, 2], SamplingParams(temperature=0.0, max_tokens=2), at)
    _assert_clean(llm)


# ---- items 5, 6, 8, 11: engine configuration --------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "banana"}, r"^device: expected a torch device"),
        ({"device": "meta"}, r"^device: expected 'cpu' or 'cuda\[:N\]'"),
        ({"num_blocks": 1}, r"^num_blocks: expected None or an int >= 2"),
        ({"num_blocks": 0}, r"^num_blocks: expected None or an int >= 2"),
        ({"num_threads": -1}, r"^num_threads: expected None \(default 1\), 0"),
        ({"num_threads": True}, r"^num_threads: expected None \(default 1\), 0"),
        ({"seed": 2**63}, r"^seed: expected"),
        ({"seed": True}, r"^seed: expected"),
        ({"enable_prefix_caching": "no"}, r"^enable_prefix_caching: expected a bool"),
        ({"backend": None}, r"^backend: expected"),
        ({"device": 3}, r"^device: expected"),
    ],
)
def test_engine_config_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_cuda_is_a_clear_spec_error() -> None:
    for dev in ("cuda", "cuda:0"):
        with pytest.raises(SpecError, match=rf"^device: expected an available device, got '{dev}'"):
            LLM(device=dev)


def test_max_model_len_capped_by_position_embeddings() -> None:
    with pytest.raises(SpecError, match=r"^max_model_len: expected <= 512 .*got 2048"):
        LLM(max_model_len=2048, num_blocks=8)
    eng = LLMEngine.from_config(max_model_len=512, num_blocks=40)
    assert eng.scheduler.max_model_len == 512


def test_num_threads_sets_torch_threads() -> None:
    before = torch.get_num_threads()
    try:
        LLMEngine.from_config(num_blocks=8, num_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_num_threads_default_is_one_and_zero_keeps_torch_default() -> None:
    """None (the default) means DEFAULT_NUM_THREADS = 1 thread, never torch's
    one-per-core default (pathologically slow on a small or shared machine); 0 leaves
    torch's setting as it is."""
    from kvpage.engine.config import DEFAULT_NUM_THREADS

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        LLMEngine.from_config(num_blocks=8)
        assert torch.get_num_threads() == DEFAULT_NUM_THREADS == 1
        torch.set_num_threads(2)
        LLMEngine.from_config(num_blocks=8, num_threads=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("temperature", [5e-324, 1e-50, 1e-39])
def test_tiny_temperature_tends_to_greedy_not_noise(llm: LLM, temperature: float) -> None:
    (greedy,) = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    p = SamplingParams(max_tokens=8, temperature=temperature, seed=1, ignore_eos=True)
    (tiny,) = llm.generate(["Once upon a time"], p)
    assert tiny.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_kv_cache_too_big_for_memory_is_a_spec_error() -> None:
    # ~400 TB: more than a 47-bit address space, so the allocation fails on any machine
    with pytest.raises(SpecError, match=r"^num_blocks: expected a KV cache that fits in cpu"):
        LLM(num_blocks=10**11)


@pytest.mark.parametrize("prompts", [None, 3, 2.5, object()])
def test_non_iterable_prompts_are_one_rejected_prompt(llm: LLM, prompts: Any) -> None:
    (out,) = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2))
    assert out.error is not None and out.error.reason == "invalid_prompt"
    _assert_clean(llm)


def test_failing_schedule_drops_running_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = LLMEngine.from_config(block_size=16, num_blocks=64)
    eng.add_request("a", [1, 5, 6], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    eng.step()  # "a" is running and holds blocks
    eng.add_request("b", [1, 7, 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))

    def broken(*a: Any, **k: Any) -> None:
        raise MemoryError("allocator broke")

    monkeypatch.setattr(eng.kv_cache_manager, "allocate", broken)
    with pytest.raises(MemoryError):
        eng.step()
    assert "a" in eng.failed_request_ids and eng.kv_cache_manager.usage == 0.0
    monkeypatch.undo()
    done = []
    while eng.has_unfinished_requests():
        done += [o.request_id for o in eng.step() if o.finished]
    assert done == ["b"] and eng.kv_cache_manager.usage == 0.0
    eng.kv_cache_manager.check_integrity()


# ---- fresh-user finding 14: the Python API refuses what the HTTP API refuses --------------
@pytest.mark.parametrize("ids", [[32000], [5, 512], [2**40]])
def test_stop_token_ids_outside_the_vocabulary_rejected(llm: LLM, ids: list[int]) -> None:
    eng = llm.llm_engine
    before = eng.get_metrics()["kvpage:requests_rejected_total"]
    with pytest.raises(RequestRejected, match=r"^stop_token_ids: expected ids in \[0, 512\)"):
        eng.add_request("r-stop", [1, 2, 3], SamplingParams(stop_token_ids=ids))
    assert eng.get_metrics()["kvpage:requests_rejected_total"] == before + 1
    _assert_clean(llm)
    # the largest id of the vocabulary is a valid stop token
    eng.add_request("r-ok", [1, 2, 3], SamplingParams(stop_token_ids=[511], max_tokens=2))
    while eng.has_unfinished_requests():
        eng.step()
    _assert_clean(llm)


@pytest.mark.parametrize("salt", ["", 7, b"x"])
def test_cache_salt_must_be_a_nonempty_string(llm: LLM, salt: Any) -> None:
    with pytest.raises(RequestRejected, match=r"^cache_salt: expected None or a non-empty"):
        llm.llm_engine.add_request("r-salt", {"prompt_token_ids": [1, 2], "cache_salt": salt})
    _assert_clean(llm)
