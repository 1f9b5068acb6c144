"""The per-step thread rule of ``ModelRunner.execute``: with a backend that runs
attention on threads of its own, a step's dense torch ops use one thread unless its
largest linear is big enough (``DENSE_THREADS_MIN_MACS``); the backend's plan still
sees every thread, and torch's count is restored after the step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpage.engine import LLM, SamplingParams
from kvpage.engine.runner import DENSE_THREADS_MIN_MACS, dense_threads


def test_rule() -> None:
    assert dense_threads(DENSE_THREADS_MIN_MACS - 1, 4) == 1
    assert dense_threads(DENSE_THREADS_MIN_MACS, 4) == 4
    assert dense_threads(0, 1) == 1


def _record(llm: LLM) -> list[tuple[int, int, int]]:
    """(rows, torch threads, plan threads or 0) of every attention call from now on."""
    backend = llm.llm_engine.backend
    seen: list[tuple[int, int, int]] = []
    orig = backend.forward

    def forward(query: torch.Tensor, cache: Any, plan: Any, spec: Any, out: Any = None) -> Any:
        seen.append((query.shape[0], torch.get_num_threads(), getattr(plan, "threads", 0)))
        return orig(query, cache, plan, spec, out)

    backend.forward = forward
    return seen


@pytest.fixture
def restore_threads() -> Any:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_small_steps_run_dense_ops_on_one_thread(restore_threads: None) -> None:
    llm = LLM(backend="native-cpu", num_threads=2)
    per_row = llm.llm_engine.runner.dense_macs[0]
    big = DENSE_THREADS_MIN_MACS // per_row + 1  # rows from which all threads are used
    seen = _record(llm)
    prompts = [{"prompt_token_ids": [1] + [5 + i % 200 for i in range(big)]}, "Once upon a time"]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    assert torch.get_num_threads() == 2  # restored after every step
    assert all(plan_threads == 2 for _, _, plan_threads in seen)  # attention: 2 parts
    small = {t for rows, t, _ in seen if rows < big}
    large = {t for rows, t, _ in seen if rows >= big}
    assert small == {1} and large == {2}


def test_backends_on_torchs_pool_keep_every_thread(restore_threads: None) -> None:
    llm = LLM(backend="torch", num_threads=2)
    seen = _record(llm)
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert seen and {t for _, t, _ in seen} == {2}


def test_the_setting_is_restored_when_the_model_raises(
    restore_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(backend="native-cpu", num_threads=2)

    def boom(*a: Any, **k: Any) -> Any:
        assert torch.get_num_threads() == 1
        raise RuntimeError("model failed")

    monkeypatch.setattr(llm.llm_engine.runner, "model", boom)
    with pytest.raises(RuntimeError, match="model failed"):
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert torch.get_num_threads() == 2


def test_a_second_threads_generate_on_one_llm_is_refused(restore_threads: None) -> None:
    """Two threads' generate calls on one LLM used to mix their requests (wrong
    outputs, a KeyError); the second now gets a RuntimeError and the first is unharmed."""
    import threading

    llm = LLM(backend="native-cpu", num_threads=1)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(["Once upon a time"], sp, use_tqdm=False)]
    eng = llm.llm_engine
    started, go = threading.Event(), threading.Event()
    real_step = eng.step

    def step(*a: Any, **k: Any) -> Any:
        started.set()
        go.wait(30)
        return real_step(*a, **k)

    eng.step = step  # type: ignore[method-assign]
    got: list[Any] = []
    t = threading.Thread(
        target=lambda: got.append(llm.generate(["Once upon a time"], sp, use_tqdm=False))
    )
    t.start()
    assert started.wait(30)
    with pytest.raises(RuntimeError, match="another thread's generate on this LLM is running"):
        llm.generate(["The little dog"], sp, use_tqdm=False)
    go.set()
    t.join(60)
    assert [o.outputs[0].token_ids for o in got[0]] == want
    eng.step = real_step  # type: ignore[method-assign]
    assert [
        o.outputs[0].token_ids for o in llm.generate(["Once upon a time"], sp, use_tqdm=False)
    ] == want


def _fork_prompts() -> list[dict[str, list[int]]]:
    """33 prompts of 5-300 random ids: prefill steps big enough for 2-thread torch ops
    (without the fork hook a child hung on this workload in 2 of 2 runs)."""
    import random

    r = random.Random(4)
    lens = [5, 40, 300, 17]
    return [
        {"prompt_token_ids": [1] + [r.randrange(3, 512) for _ in range(lens[i % 4] - 1)]}
        for i in range(33)
    ]


def _child_generate(llm: LLM, q: Any) -> None:
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate(_fork_prompts(), sp, use_tqdm=False)
    q.put((torch.get_num_threads(), [o.outputs[0].token_ids for o in outs]))


@pytest.mark.slow  # a forked torch process: ~10-20 s on a loaded 2-core box
def test_a_child_forked_after_a_two_thread_engine_runs(restore_threads: None) -> None:
    """GNU OpenMP's pool does not survive fork: a child's first parallel op used to
    hang; after an engine with 2 threads, a forked child starts on one thread."""
    import multiprocessing as mp

    llm = LLM(backend="native-cpu", num_threads=2)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(_fork_prompts(), sp, use_tqdm=False)]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_generate, args=(llm, q))
    p.start()
    try:
        threads, got = q.get(timeout=60)  # a hung child: queue.Empty
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert threads == 1 and got == want
    assert torch.get_num_threads() == 2  # the parent keeps its setting
