"""Engine throughput vs transformers, and the scheduling share of step time.

Workload (issue 4): the first 64 requests of the bundled Azure conversation trace;
prompt = ContextTokens // 8 clipped to [1, 256], output = GeneratedTokens clipped to
[1, 512 - prompt]; prompt ids random (seeded), ignore_eos, greedy; stories260K on CPU,
float32. Three runs in one process on the same weights:

* kvpage ``LLM.generate`` with all requests at once (continuous batching, paged cache);
* transformers ``generate`` one request at a time (contiguous cache);
* transformers continuous batching (``init_continuous_batching``, the manager behind
  ``generate_batch``) with each request's own ``max_new_tokens``.

Rates are given per wall second and per CPU second of this process (all its threads,
``time.process_time``); on a shared machine the CPU-second ratio is the steadier one.

Then 256 identical-shape requests run through the engine and the share of step time
spent in scheduling + block bookkeeping (``Scheduler.schedule`` and ``Scheduler.update``
plus output building) is measured over the steps whose batch is 256 sequences.

Usage: ``.venv/bin/python benches/bench_engine.py [--num-requests 64] [--threads 1]
[--out out/bench_engine.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output length) pairs by the rule in the module docstring."""
    from kvpage.workload.traces import load_trace

    rng = np.random.default_rng(seed)
    out = []
    for r in load_trace("azure-conv", limit=n).requests:
        p = int(np.clip(r.prompt_tokens // 8, 1, 256))
        m = int(np.clip(r.output_tokens, 1, 512 - p))
        ids = [1] + rng.integers(3, 512, p - 1).tolist()  # BOS then random ids
        out.append((ids, m))
    return out


def run_kvpage(work: list[tuple[list[int], int]]) -> dict[str, float]:
    from kvpage import engine as E

    llm = E.LLM("stories260K", max_num_seqs=256, max_num_batched_tokens=2048)
    llm.generate([[1, 5, 6]], E.SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    params = [E.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in work]
    st0 = llm.llm_engine.step_stats
    base = (st0.schedule_s, st0.update_s, st0.total_s)
    t, c = time.perf_counter(), time.process_time()
    outs = llm.generate([p for p, _ in work], params)
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    assert toks == sum(m for _, m in work)
    st = llm.llm_engine.step_stats
    book = (st.schedule_s - base[0]) + (st.update_s - base[1])
    return {
        "seconds": dt,
        "output_tokens": toks,
        "tokens_per_s": toks / dt,
        "cpu_seconds": cpu,
        "tokens_per_cpu_s": toks / cpu,
        "bookkeeping_share": book / (st.total_s - base[2]),
    }


def run_hf_generate(hf: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    hf.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    t, c = time.perf_counter(), time.process_time()
    toks = 0
    with torch.no_grad():
        for ids, m in work:
            x = torch.tensor([ids])
            y = hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=m,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            toks += int(y.shape[1]) - len(ids)
    return _rates(t, c, toks)


def _rates(t: float, c: float, toks: int) -> dict[str, float]:
    dt, cpu = time.perf_counter() - t, time.process_time() - c
    return {
        "seconds": dt,
        "output_tokens": toks,
        "tokens_per_s": toks / dt,
        "cpu_seconds": cpu,
        "tokens_per_cpu_s": toks / cpu,
    }


def run_hf_batch(hf: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from transformers import GenerationConfig

    cfg = GenerationConfig(
        max_new_tokens=max(m for _, m in work), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    mgr = hf.init_continuous_batching(generation_config=cfg)
    mgr.start()
    try:
        mgr.add_request([1, 5, 6], request_id="warmup", max_new_tokens=4)  # start-up off the clock
        assert mgr.get_result(request_id="warmup", timeout=600) is not None
        t, c = time.perf_counter(), time.process_time()
        for i, (ids, m) in enumerate(work):
            mgr.add_request(ids, request_id=f"r{i}", max_new_tokens=m)
        toks = 0
        for _ in work:
            res = mgr.get_result(timeout=600)
            assert res is not None
            toks += len(res.generated_tokens)
        rates = _rates(t, c, toks)
    finally:
        mgr.stop(block=True, timeout=30)
    return rates


def run_bookkeeping_at_256(num_new: int = 48) -> dict[str, float]:
    """256 requests (prompt 32 random ids, ``num_new`` tokens): the share of step time
    in scheduling + bookkeeping over steps whose batch is exactly 256 sequences, by
    wall clock (the engine's ``step_stats``) and by this thread's CPU time
    (``time.thread_time`` around ``Scheduler.schedule``/``update`` and the step), which
    a loaded machine disturbs much less."""
    from kvpage.engine import LLMEngine, SamplingParams

    eng = LLMEngine.from_config(model="stories260K", max_num_seqs=256)
    rng = np.random.default_rng(1)
    for i in range(256):
        ids = [1] + rng.integers(3, 512, 31).tolist()
        eng.add_request(
            f"b{i}", ids, SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        )
    sched = eng.scheduler
    cpu_book = [0.0]

    def timed(fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            c = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                cpu_book[0] += time.thread_time() - c

        return wrapper

    sched.schedule = timed(sched.schedule)  # type: ignore[method-assign]
    sched.update = timed(sched.update)  # type: ignore[method-assign]
    st = eng.step_stats
    book = total = cpu_total = cpu_b = 0.0
    steps = 0
    while eng.has_unfinished_requests():
        a = (st.schedule_s, st.update_s, st.total_s)
        b0, c0 = cpu_book[0], time.thread_time()
        eng.step()
        if st.last_batch_size == 256:
            book += st.schedule_s - a[0] + st.update_s - a[1]
            total += st.total_s - a[2]
            cpu_b += cpu_book[0] - b0
            cpu_total += time.thread_time() - c0
            steps += 1
    return {
        "steps": steps,
        "step_ms": 1000 * total / steps,
        "bookkeeping_share": book / total,
        "step_cpu_ms": 1000 * cpu_total / steps,
        "bookkeeping_share_cpu": cpu_b / cpu_total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = default)")
    ap.add_argument("--skip-hf", action="store_true", help="kvpage only")
    ap.add_argument("--out", default="out/bench_engine.json")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    from kvpage.models import load_model, to_transformers

    work = workload(args.num_requests)
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "num_requests": len(work),
        "prompt_tokens": sum(len(p) for p, _ in work),
    }
    res["kvpage"] = run_kvpage(work)
    print("kvpage", res["kvpage"], flush=True)
    if not args.skip_hf:
        hf = to_transformers(load_model("stories260K"))
        hf.generation_config.eos_token_id = None
        res["hf_generate"] = run_hf_generate(hf, work)
        print("hf generate", res["hf_generate"], flush=True)
        res["hf_generate_batch"] = run_hf_batch(hf, work)
        print("hf generate_batch", res["hf_generate_batch"], flush=True)
        for unit in ("tokens_per_s", "tokens_per_cpu_s"):
            k = res["kvpage"][unit]
            res[f"speedup_vs_generate ({unit})"] = k / res["hf_generate"][unit]
            res[f"speedup_vs_generate_batch ({unit})"] = k / res["hf_generate_batch"][unit]
    res["batch256"] = run_bookkeeping_at_256()
    print("batch 256", res["batch256"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
